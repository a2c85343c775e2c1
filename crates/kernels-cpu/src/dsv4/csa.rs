//! The DeepSeek-V4 CSA layer's own kernels (compress ratio 4, `docs/dsv4.md`, "CSA layer"):
//! the overlapping compressor (state rows into a ring, the pooled, normed and roped row when a
//! window closes, finished as a bf16 KV row or as a Hadamard-rotated int8 index row), the
//! indexer's query heads, its int8 scores over the visible compressed rows, and the top-k.
//!
//! # Layouts
//! - An overlapping compressor of output width `W` and ratio `r` keeps, per sequence, a ring
//!   of `2r` state rows (the previous window and the open one), row `pos % 2r`, each
//!   `[kv | score]` as two fp32 rows of `2W` channels ([`Overlap`]).
//! - Index rows are `[rows, index_head_dim]` int8 with one fp32 scale per row; index queries
//!   `[heads, index_head_dim]` int8 with one scale per head.
//! - RoPE is interleaved (pair `(2j, 2j + 1)` of the last `2 · cos.len()` values turns by the
//!   angle whose cosine and sine are `cos[j]`, `sin[j]`).
//!
//! # Paths
//! The pooling, RMSNorm and RoPE are the layer's shared kernels ([`super::softmax_pool`],
//! [`super::rms_norm_round`], [`super::rope_interleaved`]); the Hadamard transform and the
//! score finish are plain loops written in lanes and compiled twice (`multiversion!`: portable
//! and AVX2, the compiler vectorises them); the score dot products run on the int8 GEMM
//! ([`crate::gemm_i8_w8a8`], whose path is chosen at run time: AVX-VNNI, AVX2 or portable) with unit scales, so they come back as exact
//! integers and the finish applies the scales in the documented order; on AVX-512 VNNI and on
//! AMX-INT8 kernels of this module's own (`vnni`, `amx`) do the dot products and the finish
//! together. Every path gives the same bits, and so does the golden given the same inputs.

use std::ops::Range;

use super::compress::softmax_pool;
use super::norm::rms_norm_round;
use super::rope::{RopeDir, rope_interleaved};
use crate::gemm::{GemmTile, OutMode};
use crate::gemm_i8::{ActsI8, WeightsI8, gemm_i8_w8a8, quantize_row_i8_ties_away};
use crate::multiversion::multiversion;

/// The geometry of an overlapping compressor: windows of `ratio` positions, output rows of
/// `width` channels, state rows of `2 · width` (the first half pairs with the next window, the
/// second with this one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overlap {
    /// Positions per window (4 for CSA).
    pub ratio: usize,
    /// Output width `W` (`head_dim` for the main compressor, `index_head_dim` for the
    /// indexer's).
    pub width: usize,
}

impl Overlap {
    /// Rows in one sequence's ring (`2 · ratio`).
    pub fn ring_rows(&self) -> usize {
        2 * self.ratio
    }

    /// Channels of one state row (`2 · width`).
    pub fn row_width(&self) -> usize {
        2 * self.width
    }

    /// Floats of one sequence's ring of kv (or of scores).
    pub fn ring_len(&self) -> usize {
        self.ring_rows() * self.row_width()
    }

    /// Ring row of position `pos`.
    pub fn slot(&self, pos: usize) -> usize {
        pos % self.ring_rows()
    }

    /// Whether position `pos` closes a window (then its window starts at `pos + 1 - ratio`).
    pub fn closes(&self, pos: usize) -> bool {
        (pos + 1).is_multiple_of(self.ratio)
    }
}

/// Writes one token's state row into its sequence's ring: `ring_kv[slot] = kv`,
/// `ring_score[slot] = gate + ape[pos % ratio]` (`kv`, `gate` its projections, `ape` the
/// `[ratio, 2W]` position bias).
///
/// # Panics
/// If `ratio` or `width` is zero, or a slice does not have the length the geometry gives.
pub fn overlap_state_write(
    ov: Overlap,
    pos: usize,
    kv: &[f32],
    gate: &[f32],
    ape: &[f32],
    ring_kv: &mut [f32],
    ring_score: &mut [f32],
) {
    let wide = ov.row_width();
    assert!(ov.ratio > 0 && ov.width > 0, "overlap_state_write: {ov:?}");
    assert_eq!(kv.len(), wide, "overlap_state_write: kv len");
    assert_eq!(gate.len(), wide, "overlap_state_write: gate len");
    assert_eq!(ape.len(), ov.ratio * wide, "overlap_state_write: ape len");
    assert_eq!(
        ring_kv.len(),
        ov.ring_len(),
        "overlap_state_write: ring kv len"
    );
    assert_eq!(
        ring_score.len(),
        ov.ring_len(),
        "overlap_state_write: ring score len"
    );
    let row = ov.slot(pos) * wide..(ov.slot(pos) + 1) * wide;
    ring_kv[row.clone()].copy_from_slice(kv);
    let bias = &ape[(pos % ov.ratio) * wide..(pos % ov.ratio + 1) * wide];
    for ((s, &g), &b) in ring_score[row].iter_mut().zip(gate).zip(bias) {
        *s = g + b;
    }
}

/// The compressed row of the window starting at `w0` (a multiple of `ratio`) from one
/// sequence's rings, as of the write of the window's last position: per output channel `c`,
/// the softmax pool of the previous window's rows at channel `c` and this window's rows at
/// channel `W + c` (only this window's for `w0 = 0`), then `bf16(RMSNorm(·) · norm)` and RoPE
/// at `w0` on the last `2 · cos.len()` channels (`cos`, `sin`: that position's angles). `out`
/// is `W` long; its values are bf16 values except the roped ones.
///
/// # Panics
/// If `w0` is not a multiple of `ratio`, a slice has the wrong length, or RoPE is wider than
/// `W`.
#[allow(clippy::too_many_arguments)]
pub fn overlap_pool_row(
    ov: Overlap,
    ring_kv: &[f32],
    ring_score: &[f32],
    w0: usize,
    norm: &[f32],
    eps: f32,
    cos: &[f32],
    sin: &[f32],
    out: &mut [f32],
) {
    let (ratio, width, wide) = (ov.ratio, ov.width, ov.row_width());
    assert!(
        ratio > 0 && w0.is_multiple_of(ratio),
        "overlap_pool_row: window start {w0} for ratio {ratio}"
    );
    assert_eq!(
        ring_kv.len(),
        ov.ring_len(),
        "overlap_pool_row: ring kv len"
    );
    assert_eq!(
        ring_score.len(),
        ov.ring_len(),
        "overlap_pool_row: ring score len"
    );
    assert_eq!(norm.len(), width, "overlap_pool_row: norm len");
    assert_eq!(out.len(), width, "overlap_pool_row: out len");
    assert_eq!(cos.len(), sin.len(), "overlap_pool_row: cos/sin lens");
    assert!(
        2 * cos.len() <= width,
        "overlap_pool_row: rope wider than row"
    );
    // Candidates in the golden's order: the previous window's rows at channels `0..W`, then
    // this window's at `W..2W`.
    let prev = if w0 >= ratio { w0 - ratio..w0 } else { 0..0 };
    let cands: Vec<usize> = prev
        .map(|q| ov.slot(q) * wide)
        .chain((w0..w0 + ratio).map(|q| ov.slot(q) * wide + width))
        .collect();
    let kv: Vec<&[f32]> = cands.iter().map(|&o| &ring_kv[o..o + width]).collect();
    let score: Vec<&[f32]> = cands.iter().map(|&o| &ring_score[o..o + width]).collect();
    softmax_pool(&kv, &score, out);
    rms_norm_round(out, width, Some(norm), eps);
    rope_interleaved(out, width, cos, sin, RopeDir::Forward);
}

/// The orthonormal Walsh–Hadamard transform in place (Sylvester order, scaled by
/// `1/sqrt(n)`), `n = v.len()` a power of two. On the AVX-512 paths, lengths of 16 and more
/// run the first four stages inside each 16-lane register (`hadamard_avx512`); on AVX2,
/// lengths of 8 and more the first three inside each 8-lane register (`hadamard_avx2`); the
/// compiled loop left those short butterflies scalar. Every path computes the same sums and
/// differences, so they agree bit for bit.
///
/// # Panics
/// If `v.len()` is not a power of two.
pub fn hadamard_f32(v: &mut [f32]) {
    let n = v.len();
    assert!(
        n.is_power_of_two(),
        "hadamard_f32: length {n} is not a power of two"
    );
    #[cfg(target_arch = "x86_64")]
    if n >= 16 && crate::isa::Isa::current() >= crate::isa::Isa::Avx512Bf16 {
        // SAFETY: `Isa::current` is Avx512Bf16 or wider only on a CPU with AVX-512 F; `n` is
        // a power of two of at least 16.
        unsafe { hadamard_avx512(v) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if n >= 8 && crate::isa::Isa::current() >= crate::isa::Isa::Avx2 {
        // SAFETY: `Isa::current` is Avx2 or wider only on a CPU with AVX2; `n` is a power of
        // two of at least 8.
        unsafe { hadamard_avx2(v) };
        return;
    }
    hadamard_lanes(v, 1);
}

/// [`hadamard_f32`] of a power-of-two length of at least 8 on AVX2: stages 1, 2 and 4 inside
/// each register (lane `l` with bit `h` clear takes `v[l] + v[l + h]`, with it set `v[l − h] −
/// v[l]`: the sum and the difference against the partner from a permute, blended), then the
/// wider stages and the scale in [`hadamard_lanes`]: the operations of the plain butterflies
/// in the same order, so the same bits. The compiled butterflies ran the narrow stages one
/// lane at a time (the CSA index queries' Hadamard took ~40% of their per-token work on Zen 3).
///
/// # Safety
/// AVX2 available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn hadamard_avx2(v: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = v.len();
    assert!(n >= 8 && n.is_power_of_two());
    for c in v.chunks_exact_mut(8) {
        // SAFETY: `c` is 8 values.
        let mut x = unsafe { _mm256_loadu_ps(c.as_ptr()) };
        let p = _mm256_permute_ps::<0xB1>(x);
        x = _mm256_blend_ps::<0xAA>(_mm256_add_ps(x, p), _mm256_sub_ps(p, x));
        let p = _mm256_permute_ps::<0x4E>(x);
        x = _mm256_blend_ps::<0xCC>(_mm256_add_ps(x, p), _mm256_sub_ps(p, x));
        let p = _mm256_permute2f128_ps::<0x01>(x, x);
        x = _mm256_blend_ps::<0xF0>(_mm256_add_ps(x, p), _mm256_sub_ps(p, x));
        // SAFETY: as the load.
        unsafe { _mm256_storeu_ps(c.as_mut_ptr(), x) };
    }
    hadamard_lanes(v, 8);
}

/// [`hadamard_f32`] of a power-of-two length of at least 16: stages 1, 2, 4 and 8 inside each
/// register (lane `l` with bit `h` clear takes `v[l] + v[l + h]`, with it set `v[l − h] −
/// v[l]`, the partner from a permute), then the wider stages and the scale in
/// [`hadamard_lanes`].
///
/// # Safety
/// AVX-512 F available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn hadamard_avx512(v: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = v.len();
    assert!(n >= 16 && n.is_power_of_two());
    /// One in-register stage: `partner` is each lane's partner, `high` the lanes with the
    /// stage's bit set.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn stage(x: __m512, partner: __m512, high: __mmask16) -> __m512 {
        _mm512_mask_sub_ps(_mm512_add_ps(x, partner), high, partner, x)
    }
    for c in v.chunks_exact_mut(16) {
        // SAFETY: `c` is 16 values.
        let mut x = unsafe { _mm512_loadu_ps(c.as_ptr()) };
        x = stage(x, _mm512_permute_ps::<0xB1>(x), 0xAAAA);
        x = stage(x, _mm512_permute_ps::<0x4E>(x), 0xCCCC);
        x = stage(x, _mm512_shuffle_f32x4::<0xB1>(x, x), 0xF0F0);
        x = stage(x, _mm512_shuffle_f32x4::<0x4E>(x, x), 0xFF00);
        // SAFETY: as the load.
        unsafe { _mm512_storeu_ps(c.as_mut_ptr(), x) };
    }
    hadamard_lanes(v, 16);
}

multiversion! {
    avx512;
    /// [`hadamard_f32`] as plain butterflies from stage `h0` on (1: the whole transform; the
    /// vector paths pass the first stage their registers did not take), then the scale,
    /// compiled per path: the wide stages are whole-vector adds and subtracts between
    /// contiguous halves, which the compiler vectorises at each build's width.
    fn hadamard_lanes(v: &mut [f32], h0: usize) {
        let n = v.len();
        let mut h = h0;
        while h < n {
            for block in v.chunks_exact_mut(2 * h) {
                let (a, b) = block.split_at_mut(h);
                for (x, y) in a.iter_mut().zip(b.iter_mut()) {
                    let (p, q) = (*x, *y);
                    *x = p + q;
                    *y = p - q;
                }
            }
            h *= 2;
        }
        let s = 1.0 / (n as f32).sqrt();
        v.iter_mut().for_each(|x| *x *= s);
    }
}

/// An index row from the indexer compressor's row: Hadamard in place on `row`, then per-row
/// int8 into `q` (ties away from zero, the layer's rule); returns the scale.
///
/// # Panics
/// As [`hadamard_f32`], and if `q.len() != row.len()`.
pub fn index_row_i8(row: &mut [f32], q: &mut [i8]) -> f32 {
    hadamard_f32(row);
    quantize_row_i8_ties_away(row, q)
}

/// The indexer's query heads of one token from `q` (`[heads, head_dim]` fp32, overwritten):
/// per head RoPE on the last `2 · cos.len()` values, Hadamard, int8 per head into `q_i8` and
/// `q_scale`.
///
/// # Panics
/// If `q` is not a whole number of heads, `head_dim` is not a power of two, RoPE is wider than
/// a head, or the outputs do not match.
pub fn index_query_i8(
    q: &mut [f32],
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
    q_i8: &mut [i8],
    q_scale: &mut [f32],
) {
    assert!(
        head_dim > 0 && q.len().is_multiple_of(head_dim),
        "index_query_i8: {} values for heads of {head_dim}",
        q.len()
    );
    assert_eq!(cos.len(), sin.len(), "index_query_i8: cos/sin lens");
    assert!(
        2 * cos.len() <= head_dim,
        "index_query_i8: rope wider than a head"
    );
    assert_eq!(q_i8.len(), q.len(), "index_query_i8: q_i8 len");
    assert_eq!(
        q_scale.len(),
        q.len() / head_dim,
        "index_query_i8: q_scale len"
    );
    for ((head, qi), s) in q
        .chunks_exact_mut(head_dim)
        .zip(q_i8.chunks_exact_mut(head_dim))
        .zip(q_scale.iter_mut())
    {
        rope_interleaved(head, head_dim, cos, sin, RopeDir::Forward);
        *s = index_row_i8(head, qi);
    }
}

/// One sequence's int8 index queries and head weights: `tokens` rows of `heads` query heads.
#[derive(Clone, Copy, Debug)]
pub struct IndexQueries<'a> {
    /// `[tokens · heads, head_dim]` int8 (values in `-127..=127`).
    pub q: &'a [i8],
    /// `[tokens · heads]` per-head scales.
    pub scale: &'a [f32],
    /// `[tokens · heads]` head weights.
    pub weight: &'a [f32],
    /// Tokens.
    pub tokens: usize,
    /// Heads per token.
    pub heads: usize,
    /// Head dimension.
    pub head_dim: usize,
}

/// Index rows scored per GEMM call: the dot products of a chunk (`[tokens · heads, CHUNK]`
/// fp32, 128 KiB at FLASH) stay in L2.
const SCORE_CHUNK: usize = 256;

/// Scores of compressed rows `rows` of one sequence for each token:
/// `out[t · ld_out + c − rows.start] = key_scale[c] · Σ_h relu((q[t,h] · keys[c]) · q_scale[t,h]) · weight[t,h]`,
/// the head sum taken in order from `−0.0` (as an iterator sum), the dot products exact.
/// `keys` is `[≥ rows.end, head_dim]` int8, `key_scale` one scale per row.
///
/// # Panics
/// If a slice is shorter than its shape, `rows` runs past the keys, `ld_out` is narrower
/// than `rows`, or a query holds `-128` (outside [`IndexQueries::q`]'s range; refused on every
/// path, as the int8 GEMM refuses such activations).
pub fn index_scores(
    qs: IndexQueries<'_>,
    keys: &[i8],
    key_scale: &[f32],
    rows: Range<usize>,
    out: &mut [f32],
    ld_out: usize,
) {
    let (tokens, heads, dim) = (qs.tokens, qs.heads, qs.head_dim);
    // Every size is checked arithmetic: the fast paths read through pointers whose bounds are
    // these asserts, so a product that wrapped would let them read past the slices.
    let nq = tokens
        .checked_mul(heads)
        .expect("index_scores: tokens x heads overflows");
    let q_len = nq
        .checked_mul(dim)
        .expect("index_scores: the queries' size overflows");
    assert!(dim > 0, "index_scores: head_dim 0");
    assert!(
        qs.q.len() >= q_len && qs.scale.len() >= nq && qs.weight.len() >= nq,
        "index_scores: queries shorter than {tokens} x {heads} heads of {dim}"
    );
    assert!(
        rows.start <= rows.end
            && rows.end <= key_scale.len()
            && rows.end.checked_mul(dim).is_some_and(|k| keys.len() >= k),
        "index_scores: rows {rows:?} past the {} keys",
        key_scale.len()
    );
    for (r, q) in qs.q[..q_len].chunks_exact(dim).enumerate() {
        assert!(
            !crate::gemm_i8::holds_i8_min(q),
            "index_scores: query row {r} holds -128"
        );
    }
    let n = rows.len();
    if n == 0 || tokens == 0 {
        return;
    }
    assert!(
        tokens == 1 || ld_out >= n,
        "index_scores: ld_out {ld_out} < {n}"
    );
    assert!(
        (tokens - 1)
            .checked_mul(ld_out)
            .and_then(|o| o.checked_add(n))
            .is_some_and(|need| out.len() >= need),
        "index_scores: out too short"
    );
    #[cfg(target_arch = "x86_64")]
    if dim.is_multiple_of(amx::KSTEP) && crate::gemm_i8::I8Path::current() == crate::I8Path::Amx {
        // SAFETY: `I8Path::current` is AMX only when this CPU has AMX-INT8 and AVX-512
        // F/BW/VNNI and the tile state was granted; the slices were checked above.
        unsafe { amx::scores(&qs, keys, key_scale, rows, out, ld_out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if dim.is_multiple_of(4)
        && crate::gemm_i8::I8Path::current() >= crate::gemm_i8::I8Path::Avx512Vnni
    {
        // SAFETY: `I8Path::current` is AVX-512 VNNI or AMX only when this CPU has AVX-512
        // F/BW/VNNI; the slices were checked above (queries, keys up to `rows.end`, output).
        unsafe { vnni::scores(&qs, keys, key_scale, rows, out, ld_out) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if dim.is_multiple_of(avx2::DIMS_PER_STEP)
        && crate::gemm_i8::I8Path::current() == crate::gemm_i8::I8Path::Avx2
    {
        // SAFETY: `I8Path::current` is AVX2 only when this CPU has AVX2; the slices were
        // checked above (queries, keys up to `rows.end`, output); `dim` is a whole number of
        // transpose steps.
        unsafe { avx2::scores(&qs, keys, key_scale, rows, out, ld_out) };
        return;
    }
    // Unit scales: the GEMM returns `dot as f32`, exact (|dot| <= 127² · dim < 2^24 for the
    // dims a config allows) and the finish below applies the real scales.
    let ones = vec![1.0f32; nq.max(SCORE_CHUNK)];
    let acts = ActsI8::new(&qs.q[..nq * dim], &ones[..nq], nq, dim, dim);
    let mut dots = vec![0.0f32; nq * SCORE_CHUNK];
    let mut c0 = rows.start;
    while c0 < rows.end {
        let m = SCORE_CHUNK.min(rows.end - c0);
        let w = WeightsI8::new(&keys[c0 * dim..(c0 + m) * dim], &ones[..m], m, dim, dim);
        let tile = GemmTile {
            n: 0..m,
            k: 0..dim,
            mode: OutMode::Store,
        };
        gemm_i8_w8a8(w, acts, &tile, &mut dots, SCORE_CHUNK);
        for t in 0..tokens {
            let o = t * ld_out + (c0 - rows.start);
            finish_scores(
                &dots[t * heads * SCORE_CHUNK..(t + 1) * heads * SCORE_CHUNK],
                &qs.scale[t * heads..(t + 1) * heads],
                &qs.weight[t * heads..(t + 1) * heads],
                &key_scale[c0..c0 + m],
                &mut out[o..o + m],
            );
        }
        c0 += m;
    }
}

multiversion! {
    /// `out[c] = key_scale[c] · Σ_h relu(dots[h][c] · q_scale[h]) · weight[h]` (rows of
    /// `dots` [`SCORE_CHUNK`] apart), summed over `h` in order from `−0.0`, lanes across `c`.
    fn finish_scores(dots: &[f32], q_scale: &[f32], weight: &[f32], key_scale: &[f32], out: &mut [f32]) {
        let m = out.len();
        out.fill(-0.0);
        for (h, (&qs, &w)) in q_scale.iter().zip(weight).enumerate() {
            let d = &dots[h * SCORE_CHUNK..h * SCORE_CHUNK + m];
            for (o, &v) in out.iter_mut().zip(d) {
                *o += (v * qs).max(0.0) * w;
            }
        }
        for (o, &s) in out.iter_mut().zip(key_scale) {
            *o *= s;
        }
    }
}

/// The AVX-512 VNNI scores: 16 index rows per vector lane set, keys transposed per block into
/// `[dim / 4][16 rows][4 bytes]` so each `vpdpbusd` multiplies one broadcast query quad by the
/// same quad of 16 rows. `vpdpbusd` takes unsigned × signed bytes: the query enters as
/// `q + 128` (a xor of the sign bit) and `128 · Σ key` per row, summed alongside, is taken
/// off; the sums are exact. The finish is the documented expression in the documented order
/// (multiply, max with 0, multiply, add, heads in order from `−0.0`, no fused multiply-add),
/// so it gives the same bits as the other paths.
///
/// Two key blocks (32 rows) go together against [`HEADS`] query heads: 16 independent
/// accumulator chains, each broadcast query quad feeding two `vpdpbusd`. The first form (one
/// block × 4 heads: four chains, a broadcast per instruction) ran at a fraction of the
/// `vpdpbusd` rate on Zen 4, whose `vpdpbusd` has a multi-cycle latency at one a cycle
/// (`docs/benchmarks.md`, session 44).
#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{IndexQueries, add_head_term, store_scores, transpose_keys};

    /// Query heads processed together (independent accumulator chains per key block).
    const HEADS: usize = 8;

    /// # Safety
    /// AVX-512 F/BW/VNNI available; `qs` holds `tokens · heads` rows of `head_dim` (a multiple
    /// of 4) with their scales and weights, `keys` and `key_scale` reach `rows.end`, `out`
    /// holds `tokens` rows of `rows.len()` at stride `ld_out`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn scores(
        qs: &IndexQueries<'_>,
        keys: &[i8],
        key_scale: &[f32],
        rows: Range<usize>,
        out: &mut [f32],
        ld_out: usize,
    ) {
        let (tokens, heads, dim) = (qs.tokens, qs.heads, qs.head_dim);
        // Query quads as unsigned bytes (`q ^ 0x80` = `q + 128`), 64 bytes per xor: built a
        // quad at a time (a call per quad) this was a quarter of a FLASH call's time.
        let q = &qs.q[..tokens * heads * dim];
        let mut qd = vec![0i32; q.len() / 4];
        let flip = _mm512_set1_epi8(0x80u8 as i8);
        let (body, tail) = q.as_chunks::<64>();
        for (i, c) in body.iter().enumerate() {
            // SAFETY: 64 bytes of `q`, written to quads `16 i .. 16 i + 16` of `qd` (`q.len() / 4`
            // quads, `64 (i + 1) <= q.len()`).
            unsafe {
                let v = _mm512_xor_si512(_mm512_loadu_si512(c.as_ptr().cast()), flip);
                _mm512_storeu_si512(qd.as_mut_ptr().add(16 * i).cast(), v);
            }
        }
        for (o, b) in qd[body.len() * 16..].iter_mut().zip(tail.chunks_exact(4)) {
            *o = i32::from_le_bytes([
                b[0] as u8 ^ 0x80,
                b[1] as u8 ^ 0x80,
                b[2] as u8 ^ 0x80,
                b[3] as u8 ^ 0x80,
            ]);
        }
        let mut blk = vec![0i32; 2 * dim / 4 * 16];
        let mut c0 = rows.start;
        while c0 < rows.end {
            let left = rows.end - c0;
            // SAFETY: forwarded contract; the blocks' rows lie in `c0..rows.end`.
            unsafe {
                if left > 16 {
                    let n = [16, 16.min(left - 16)];
                    blocks::<2>(
                        qs, &qd, keys, key_scale, c0, n, &mut blk, rows.start, out, ld_out,
                    );
                    c0 += 16 + n[1];
                } else {
                    blocks::<1>(
                        qs,
                        &qd,
                        keys,
                        key_scale,
                        c0,
                        [left],
                        &mut blk,
                        rows.start,
                        out,
                        ld_out,
                    );
                    c0 += left;
                }
            }
        }
    }

    /// The scores of `B` consecutive key blocks from row `c0` (`n[b]` rows each, at most 16;
    /// only the last may be short) for every token.
    ///
    /// # Safety
    /// As [`scores`]; the blocks' rows lie below `rows.end`; `blk` holds `B · dim / 4 · 16`
    /// values; `qd` holds `tokens · heads · dim / 4` quads.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[allow(clippy::too_many_arguments, reason = "one call's operands, forwarded")]
    unsafe fn blocks<const B: usize>(
        qs: &IndexQueries<'_>,
        qd: &[i32],
        keys: &[i8],
        key_scale: &[f32],
        c0: usize,
        n: [usize; B],
        blk: &mut [i32],
        row0: usize,
        out: &mut [f32],
        ld_out: usize,
    ) {
        let (tokens, heads, dim) = (qs.tokens, qs.heads, qs.head_dim);
        let quads = dim / 4;
        let ones = _mm512_set1_epi8(1);
        let mut corr = [_mm512_setzero_si512(); B];
        let mut kscale = [_mm512_setzero_ps(); B];
        let mut mask = [0 as __mmask16; B];
        for b in 0..B {
            let r0 = c0 + 16 * b;
            transpose_keys(
                &keys[r0 * dim..(r0 + n[b]) * dim],
                dim,
                &mut blk[b * quads * 16..(b + 1) * quads * 16],
            );
            // 128 · Σ_k key[l][k] per lane.
            let mut ksum = _mm512_setzero_si512();
            for j in 0..quads {
                // SAFETY: `blk` holds `B · quads · 16` i32 values.
                let k =
                    unsafe { _mm512_loadu_si512(blk.as_ptr().add((b * quads + j) * 16).cast()) };
                ksum = _mm512_dpbusd_epi32(ksum, ones, k);
            }
            corr[b] = _mm512_slli_epi32::<7>(ksum);
            mask[b] = if n[b] == 16 {
                0xFFFF
            } else {
                (1u16 << n[b]) - 1
            };
            // SAFETY: the mask covers `n[b]` rows of `key_scale` from `r0` (< rows.end <= len).
            kscale[b] = unsafe { _mm512_maskz_loadu_ps(mask[b], key_scale.as_ptr().add(r0)) };
        }
        let kp: [*const i32; B] = std::array::from_fn(|b| blk[b * quads * 16..].as_ptr());
        let qp = qd.as_ptr();
        for t in 0..tokens {
            let mut acc_s = [_mm512_set1_ps(-0.0); B];
            let mut h = 0;
            while h + HEADS <= heads {
                let r = t * heads + h;
                // `a[b][i]`: block `b` against head `h + i`. Heads outer, blocks inner: each
                // broadcast query quad meets every block's keys.
                let mut a = [[_mm512_setzero_si512(); HEADS]; B];
                #[allow(clippy::needless_range_loop, reason = "a[b][i]: two dimensions")]
                for j in 0..quads {
                    // SAFETY: each block holds `quads · 16` values; rows `r..r + HEADS` of
                    // `qd` hold `quads` each.
                    unsafe {
                        let k: [__m512i; B] =
                            std::array::from_fn(|b| _mm512_loadu_si512(kp[b].add(j * 16).cast()));
                        for i in 0..HEADS {
                            let q = _mm512_set1_epi32(*qp.add((r + i) * quads + j));
                            for b in 0..B {
                                a[b][i] = _mm512_dpbusd_epi32(a[b][i], q, k[b]);
                            }
                        }
                    }
                }
                // Each block's head terms in head order: `relu(dot · q_scale) · weight`.
                #[allow(clippy::needless_range_loop, reason = "a[b][i]: two dimensions")]
                for i in 0..HEADS {
                    for b in 0..B {
                        acc_s[b] =
                            add_head_term(acc_s[b], _mm512_sub_epi32(a[b][i], corr[b]), qs, r + i);
                    }
                }
                h += HEADS;
            }
            while h < heads {
                let r = t * heads + h;
                let mut a = [_mm512_setzero_si512(); B];
                for j in 0..quads {
                    // SAFETY: as above.
                    unsafe {
                        let q = _mm512_set1_epi32(*qp.add(r * quads + j));
                        for b in 0..B {
                            a[b] = _mm512_dpbusd_epi32(
                                a[b],
                                q,
                                _mm512_loadu_si512(kp[b].add(j * 16).cast()),
                            );
                        }
                    }
                }
                for b in 0..B {
                    acc_s[b] = add_head_term(acc_s[b], _mm512_sub_epi32(a[b], corr[b]), qs, r);
                }
                h += 1;
            }
            for b in 0..B {
                store_scores(
                    acc_s[b],
                    kscale[b],
                    mask[b],
                    out,
                    t * ld_out + (c0 + 16 * b - row0),
                );
            }
        }
    }
}

/// The AVX2 scores (no VNNI) on 16-bit values: each 16-row key block transposed once into
/// pairs of dimensions widened to i16 (`[dim / 2][16 rows]`, a pair in each 32-bit lane) and
/// read as two 8-lane halves, each query widened once per call. A query pair broadcast to
/// every lane meets the same pair of 8 rows: one `vpmaddwd` multiplies and adds it into the
/// lane's i32, so each lane sums its row's exact dot product with no horizontal sum, and the
/// finish runs on 8 rows per vector in the documented order, the same bits as every other
/// path. The sign trick this replaced (`vpsignb`, `vpmaddubsw`, `vpmaddwd` per quad of 8 rows)
/// put three instructions on the two pipes of Zen 3 that run them where this puts two, and
/// needed the queries free of `-128`: 0.94× the time a call (`docs/benchmarks.md`, session
/// 37). Against the row-major GEMM the first AVX2 kernel replaced (query rows as its batch,
/// `k` only 128 bytes), whose blocks spent more on starting, reducing and finishing than on
/// the four steps of products: see `docs/benchmarks.md` for the measured rates.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::IndexQueries;
    use crate::simd::transpose8;

    /// Query heads processed together: `2 · HEADS` accumulators, the two key vectors and the
    /// broadcast pair fit 16 registers. At FLASH (`examples/dsv4_csa_scores`, Zen 3, best of
    /// 15 rounds, three alternations) 6 heads took 58.2–58.8 us a call, 4 heads 60.8–61.3, 8
    /// (spilled) ~125, the sign-trick kernel 62.1–62.2; the 4 heads left after ten blocks
    /// of 6 go one by one (a block of 4 for them measured 61 us).
    const HEADS: usize = 6;

    /// Dimensions per transpose step: 8 pairs of each of 8 rows, one 8 × 8 transpose of
    /// 32-bit lanes. `dim` must be a multiple of it.
    pub(super) const DIMS_PER_STEP: usize = 16;

    /// `keys` (up to 16 rows of `dim` bytes; the missing rows zero) widened to i16 and
    /// transposed into `blk` (`dim / 2 · 16` lanes: dimensions `2p, 2p + 1` of row `l` in
    /// `blk[p · 16 + l]`, the lower one in the low half), by 8 × 8 transposes of 32-bit lanes.
    ///
    /// # Safety
    /// AVX2 available; `dim` a multiple of [`DIMS_PER_STEP`]; `keys.len() <= 16 · dim`, a
    /// whole number of rows; `blk` holds `dim / 2 · 16` values.
    #[target_feature(enable = "avx2")]
    unsafe fn transpose_block(keys: &[i8], dim: usize, blk: &mut [i32]) {
        let n = keys.len() / dim;
        let pairs = dim / 2;
        assert!(n <= 16 && blk.len() >= pairs * 16, "transpose_block");
        for half in 0..2 {
            for d0 in (0..dim).step_by(DIMS_PER_STEP) {
                let rows: [__m256; 8] = std::array::from_fn(|l| {
                    let r = half * 8 + l;
                    if r < n {
                        // SAFETY: row `r < n` holds `dim` bytes and `d0 + 16 <= dim`.
                        unsafe {
                            _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_loadu_si128(
                                keys.as_ptr().add(r * dim + d0).cast(),
                            )))
                        }
                    } else {
                        _mm256_setzero_ps()
                    }
                });
                for (i, v) in transpose8(rows).into_iter().enumerate() {
                    let at = (d0 / 2 + i) * 16 + half * 8;
                    // SAFETY: `d0 / 2 + i < pairs`, so 8 values from `at` lie inside `blk`.
                    unsafe {
                        _mm256_storeu_si256(blk.as_mut_ptr().add(at).cast(), _mm256_castps_si256(v))
                    };
                }
            }
        }
    }

    /// One head's term of the finish added to 8 rows' sums: `acc + relu(dot · q_scale[r]) ·
    /// weight[r]`, in that order, no fused multiply-add (as `super::add_head_term`).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn head_term(acc: __m256, dot: __m256i, qs: &IndexQueries<'_>, r: usize) -> __m256 {
        let v = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(qs.scale[r]));
        let v = _mm256_max_ps(v, _mm256_setzero_ps());
        _mm256_add_ps(acc, _mm256_mul_ps(v, _mm256_set1_ps(qs.weight[r])))
    }

    /// `acc[h][half]` = the dot products of query rows `r..r + H` (widened, `2 · pairs` values
    /// apart, at `q`) with the block's two 8-row halves.
    ///
    /// # Safety
    /// AVX2 available; `H` query rows of `2 · pairs` values readable at `q`; `blk` holds
    /// `pairs · 16` values.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn dots<const H: usize>(q: *const i16, pairs: usize, blk: &[i32]) -> [[__m256i; 2]; H] {
        let mut acc = [[_mm256_setzero_si256(); 2]; H];
        for p in 0..pairs {
            // SAFETY: `p < pairs`: 16 values at `p · 16` (contract).
            let k = unsafe {
                let kp = blk.as_ptr().add(p * 16).cast::<__m256i>();
                [_mm256_loadu_si256(kp), _mm256_loadu_si256(kp.add(1))]
            };
            for (h, acc) in acc.iter_mut().enumerate() {
                // SAFETY: pair `p` of query row `h < H` (contract).
                let qb = _mm256_set1_epi32(unsafe {
                    q.add(h * 2 * pairs + 2 * p).cast::<i32>().read_unaligned()
                });
                for half in 0..2 {
                    acc[half] = _mm256_add_epi32(acc[half], _mm256_madd_epi16(k[half], qb));
                }
            }
        }
        acc
    }

    /// # Safety
    /// AVX2 available; `qs` holds `tokens · heads` rows of `head_dim` (a multiple of
    /// [`DIMS_PER_STEP`]) with their scales and weights; `keys` and `key_scale` reach
    /// `rows.end`; `out` holds `tokens` rows of `rows.len()` at stride `ld_out`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn scores(
        qs: &IndexQueries<'_>,
        keys: &[i8],
        key_scale: &[f32],
        rows: Range<usize>,
        out: &mut [f32],
        ld_out: usize,
    ) {
        let (tokens, heads, dim) = (qs.tokens, qs.heads, qs.head_dim);
        let pairs = dim / 2;
        let q16: Vec<i16> = qs.q[..tokens * heads * dim]
            .iter()
            .map(|&v| i16::from(v))
            .collect();
        let mut blk = vec![0i32; pairs * 16];
        let mut c0 = rows.start;
        while c0 < rows.end {
            let n = 16.min(rows.end - c0);
            // SAFETY: AVX2 (contract); `dim` a multiple of `DIMS_PER_STEP`; `n <= 16` rows;
            // `blk` holds `pairs · 16` values.
            unsafe { transpose_block(&keys[c0 * dim..(c0 + n) * dim], dim, &mut blk) };
            let mut kscale = [0.0f32; 16];
            kscale[..n].copy_from_slice(&key_scale[c0..c0 + n]);
            for t in 0..tokens {
                let mut acc_s = [_mm256_set1_ps(-0.0); 2];
                let mut h = 0;
                while h < heads {
                    let r = t * heads + h;
                    let q = q16[r * dim..].as_ptr();
                    if h + HEADS <= heads {
                        // SAFETY: AVX2; query rows `r..r + HEADS` (`h + HEADS <= heads`) hold
                        // `dim` values each; `blk` holds `pairs · 16` values.
                        let a = unsafe { dots::<HEADS>(q, pairs, &blk) };
                        for (i, a) in a.iter().enumerate() {
                            for half in 0..2 {
                                acc_s[half] = head_term(acc_s[half], a[half], qs, r + i);
                            }
                        }
                        h += HEADS;
                    } else {
                        // SAFETY: as above, for query row `r`.
                        let [a] = unsafe { dots::<1>(q, pairs, &blk) };
                        for half in 0..2 {
                            acc_s[half] = head_term(acc_s[half], a[half], qs, r);
                        }
                        h += 1;
                    }
                }
                let mut v = [0.0f32; 16];
                for ((v, ks), acc) in v.chunks_exact_mut(8).zip(kscale.chunks_exact(8)).zip(acc_s) {
                    // SAFETY: 8 floats in each chunk.
                    unsafe {
                        _mm256_storeu_ps(
                            v.as_mut_ptr(),
                            _mm256_mul_ps(acc, _mm256_loadu_ps(ks.as_ptr())),
                        )
                    };
                }
                let o = t * ld_out + (c0 - rows.start);
                out[o..o + n].copy_from_slice(&v[..n]);
            }
            c0 += n;
        }
    }
}

/// One head's term of the score finish added to the 16 rows' sums: `acc + relu(dot ·
/// q_scale[r]) · weight[r]` (`dot` the exact integer products), in that order, no fused
/// multiply-add — what every path computes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn add_head_term(
    acc: std::arch::x86_64::__m512,
    dot: std::arch::x86_64::__m512i,
    qs: &IndexQueries<'_>,
    r: usize,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let v = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(qs.scale[r]));
    let v = _mm512_max_ps(v, _mm512_setzero_ps());
    _mm512_add_ps(acc, _mm512_mul_ps(v, _mm512_set1_ps(qs.weight[r])))
}

/// The 16 rows' head sums times their key scales, stored to the `mask`ed rows of `out` from
/// `o`.
///
/// # Panics
/// If the masked rows run past `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn store_scores(
    acc: std::arch::x86_64::__m512,
    kscale: std::arch::x86_64::__m512,
    mask: std::arch::x86_64::__mmask16,
    out: &mut [f32],
    o: usize,
) {
    use std::arch::x86_64::*;
    assert!(
        o + (16 - mask.leading_zeros() as usize) <= out.len(),
        "index scores: out"
    );
    // SAFETY: the mask's rows from `o` are inside `out` (asserted; its set bits are the low
    // ones).
    unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(o), mask, _mm512_mul_ps(acc, kscale)) };
}

/// The key block of up to 16 rows (`keys`, rows of `dim` bytes) transposed into `blk`
/// (`dim / 4 · 16` values): quad `j` of row `l` at `blk[j · 16 + l]` (four bytes of one row,
/// little-endian), the missing rows zero. This is both the `vpdpbusd` operand of `vnni` and
/// the B tile layout of `amx` (16 lines of 16 rows × 4 bytes per 64 bytes of `dim`).
///
/// A whole block (16 rows, `dim` a multiple of 64) goes through AVX-512 where the CPU has it:
/// each 64 bytes of the 16 rows are a 16 × 16 matrix of 32-bit quads, transposed in registers
/// (the scalar loop was a sixth of the AMX scores' time at FLASH shape).
#[cfg(target_arch = "x86_64")]
fn transpose_keys(keys: &[i8], dim: usize, blk: &mut [i32]) {
    if keys.len() >= 16 * dim
        && dim.is_multiple_of(64)
        && blk.len() >= dim / 4 * 16
        && is_x86_feature_detected!("avx512f")
    {
        // SAFETY: AVX-512 F available (checked just above); the lengths were checked.
        unsafe { transpose_keys_avx512(keys, dim, blk) };
        return;
    }
    blk.fill(0);
    for (l, row) in keys.chunks_exact(dim).take(16).enumerate() {
        for (j, q) in row.chunks_exact(4).enumerate() {
            blk[j * 16 + l] = i32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]);
        }
    }
}

/// [`transpose_keys`] of a whole block: 16 rows, `dim` a multiple of 64.
///
/// # Safety
/// AVX-512 F available; `keys.len() >= 16 · dim`, `blk.len() >= dim / 4 · 16`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_keys_avx512(keys: &[i8], dim: usize, blk: &mut [i32]) {
    use std::arch::x86_64::*;
    assert!(keys.len() >= 16 * dim && blk.len() >= dim / 4 * 16 && dim.is_multiple_of(64));
    for c in 0..dim / 64 {
        // SAFETY: row `l`'s bytes `64 c .. 64 c + 64` lie inside `keys` (asserted).
        let mut r: [__m512i; 16] = std::array::from_fn(|l| unsafe {
            _mm512_loadu_si512(keys.as_ptr().add(l * dim + c * 64).cast())
        });
        crate::gemm::amx_transpose16(&mut r);
        for (j, v) in r.iter().enumerate() {
            // SAFETY: quads `16 c .. 16 c + 16` of the 16 rows: values `(16 c + j) · 16 ..
            // + 16` of `blk`, inside it (asserted).
            unsafe { _mm512_storeu_si512(blk.as_mut_ptr().add((c * 16 + j) * 16).cast(), *v) };
        }
    }
}

/// The AMX-INT8 scores: per block of 16 index rows (transposed once by [`transpose_keys`], the
/// `B` operand, 1 KiB per 64 bytes of `dim`), `tdpbssd` of every 16 query rows (the `A`
/// operand: the queries as they lie, or in a copy padded with zero rows when they do not fill
/// whole pairs of 16) gives the exact signed dot products `[query row, 16 index rows]`; the
/// finish is the `vnni` kernel's, the documented expression in the documented order, so every
/// path gives the same bits. At FLASH shape (`examples/dsv4_csa_scores`, one 256-row chunk of
/// 2 tokens × 64 heads per call, warm) a call took 12.9–13.0 µs with a padded copy of the
/// queries made per call, the keys transposed by a scalar loop and every step on the same
/// tiles, and 4.3–4.4 µs with the queries read in place, the transpose in registers, the steps
/// alternating tiles and the key tiles and dots on whole 64-byte lines. Queries that start
/// off a 64-byte line cost ~25% more per call (every tile row then spans two lines); the
/// step's query tensors start on one.
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{IndexQueries, add_head_term, store_scores, transpose_keys};
    use crate::gemm::amx_tile_config;

    /// Bytes of `dim` per tile step.
    pub(super) const KSTEP: usize = 64;

    /// `len` values of `buf` (at least 15 longer) from its first 64-byte boundary.
    fn aligned_lines(buf: &mut [i32], len: usize) -> &mut [i32] {
        let at = buf.as_ptr().align_offset(64).min(buf.len() - len);
        &mut buf[at..at + len]
    }

    /// # Safety
    /// AMX-INT8 and AVX-512 F/BW available and the tile state granted; `qs` holds
    /// `tokens · heads` rows of `head_dim` (a multiple of [`KSTEP`]) with their scales and
    /// weights, `keys` and `key_scale` reach `rows.end`, `out` holds `tokens` rows of
    /// `rows.len()` at stride `ld_out`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn scores(
        qs: &IndexQueries<'_>,
        keys: &[i8],
        key_scale: &[f32],
        rows: Range<usize>,
        out: &mut [f32],
        ld_out: usize,
    ) {
        let (tokens, heads, dim) = (qs.tokens, qs.heads, qs.head_dim);
        let nq = tokens * heads;
        assert!(
            dim > 0 && dim.is_multiple_of(KSTEP),
            "amx scores: head_dim {dim}"
        );
        // The queries in whole pairs of 16-row tiles: as they lie when they fill them, else
        // a copy padded with zero rows.
        let groups = nq.div_ceil(32) * 2;
        let padded;
        let qp: &[i8] = if nq == groups * 16 {
            &qs.q[..nq * dim]
        } else {
            let mut p = vec![0i8; groups * 16 * dim];
            p[..nq * dim].copy_from_slice(&qs.q[..nq * dim]);
            padded = p;
            &padded
        };
        let steps = dim / KSTEP;
        // Both start on a 64-byte line, as the tile rows they hold (a row across two lines
        // loads and stores slower).
        let mut blk_buf = vec![0i32; dim / 4 * 16 + 16];
        let blk = aligned_lines(&mut blk_buf, dim / 4 * 16);
        // Dots of one block of 16 index rows: row `r` (query row) at `dots[r · 16..]`.
        let mut dots_buf = vec![0i32; groups * 16 * 16 + 16];
        let dots = aligned_lines(&mut dots_buf, groups * 16 * 16);
        // SAFETY: the configuration is the crate's palette-1 layout (eight 16 × 64-byte tiles);
        // the tile state was granted (contract). Released below; nothing between uses tiles
        // otherwise.
        unsafe { asm!("ldtilecfg [{}]", in(reg) amx_tile_config(), options(nostack, readonly)) };
        let mut c0 = rows.start;
        while c0 < rows.end {
            let n = 16.min(rows.end - c0);
            transpose_keys(&keys[c0 * dim..(c0 + n) * dim], dim, blk);
            for g in (0..groups).step_by(2) {
                // Steps go in pairs on separate tiles (tmm4–tmm6, then tmm2, tmm3, tmm7): the
                // tile registers are not renamed, so a load into a tile the previous
                // `tdpbssd` still reads waits for it; alternating lets the next step's loads
                // run under this step's products.
                // SAFETY: A: query rows 16 g .. 16 g + 32 of `qp` (groups is even, so they
                // exist) at a stride of `dim` bytes, 64 bytes per step, `steps` steps (in
                // pairs, then one) inside a row. B: `blk` holds `steps` tiles of 16 lines of
                // 64 bytes. C: rows 16 g .. 16 g + 32 of `dots`, 64 bytes each.
                unsafe {
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "test {n2}, {n2}",
                        "jz 3f",
                        "2:",
                        "tileloadd tmm4, [{a0} + {sa}*1]",
                        "tileloadd tmm5, [{a1} + {sa}*1]",
                        "tileloadd tmm6, [{b} + {s64}*1]",
                        "tdpbssd tmm0, tmm4, tmm6",
                        "tdpbssd tmm1, tmm5, tmm6",
                        "tileloadd tmm2, [{a0} + {sa}*1 + 64]",
                        "tileloadd tmm3, [{a1} + {sa}*1 + 64]",
                        "tileloadd tmm7, [{b} + {s64}*1 + 1024]",
                        "tdpbssd tmm0, tmm2, tmm7",
                        "tdpbssd tmm1, tmm3, tmm7",
                        "add {a0}, 128",
                        "add {a1}, 128",
                        "add {b}, 2048",
                        "dec {n2}",
                        "jnz 2b",
                        "3:",
                        "test {odd}, {odd}",
                        "jz 4f",
                        "tileloadd tmm4, [{a0} + {sa}*1]",
                        "tileloadd tmm5, [{a1} + {sa}*1]",
                        "tileloadd tmm6, [{b} + {s64}*1]",
                        "tdpbssd tmm0, tmm4, tmm6",
                        "tdpbssd tmm1, tmm5, tmm6",
                        "4:",
                        "tilestored [{c} + {s64}*1], tmm0",
                        "tilestored [{c} + {s64}*1 + 1024], tmm1",
                        a0 = inout(reg) qp.as_ptr().add(g * 16 * dim) => _,
                        a1 = inout(reg) qp.as_ptr().add((g + 1) * 16 * dim) => _,
                        sa = in(reg) dim,
                        b = inout(reg) blk.as_ptr() => _,
                        s64 = in(reg) 64usize,
                        n2 = inout(reg) steps / 2 => _,
                        odd = in(reg) steps % 2,
                        c = in(reg) dots.as_mut_ptr().add(g * 256),
                        options(nostack),
                    );
                }
            }
            let mask: __mmask16 = if n == 16 { 0xFFFF } else { (1u16 << n) - 1 };
            // SAFETY: the mask covers `n` rows of `key_scale` from `c0` (< rows.end <= len).
            let kscale = unsafe { _mm512_maskz_loadu_ps(mask, key_scale.as_ptr().add(c0)) };
            for t in 0..tokens {
                let mut acc_s = _mm512_set1_ps(-0.0);
                for h in 0..heads {
                    let r = t * heads + h;
                    // SAFETY: row `r < nq` of `dots` is 16 values.
                    let a = unsafe { _mm512_loadu_si512(dots.as_ptr().add(r * 16).cast()) };
                    acc_s = add_head_term(acc_s, a, qs, r);
                }
                store_scores(acc_s, kscale, mask, out, t * ld_out + (c0 - rows.start));
            }
            c0 += n;
        }
        // SAFETY: releases the tile state configured above.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// The best `min(k, scores.len())` rows into `out` (cleared first), best first, ties to the
/// lower row (scores ordered by `f32::total_cmp`).
///
/// # Panics
/// If there are more than `2³²` rows (they are numbered in `u32`).
pub fn top_k_rows(scores: &[f32], k: usize, out: &mut Vec<u32>) {
    let n = scores.len();
    assert!(
        u32::try_from(n.saturating_sub(1)).is_ok(),
        "top_k_rows: {n} rows"
    );
    let k = k.min(n);
    out.clear();
    if k == 0 {
        return;
    }
    // One integer key per row whose ascending order is (score descending by `total_cmp`, row
    // ascending): the selection and the sort compare plain integers.
    let mut keys: Vec<u64> = scores
        .iter()
        .enumerate()
        .map(|(r, &v)| (u64::from(!total_order_bits(v)) << 32) | r as u64)
        .collect();
    if k < n {
        keys.select_nth_unstable(k - 1);
        keys.truncate(k);
    }
    keys.sort_unstable();
    out.extend(keys.iter().map(|&key| key as u32));
}

/// `v`'s bits as a `u32` whose unsigned order is [`f32::total_cmp`]'s order of the values.
#[inline]
fn total_order_bits(v: f32) -> u32 {
    let b = v.to_bits();
    if b >> 31 == 1 { !b } else { b | 0x8000_0000 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hadamard_is_orthonormal_and_self_inverse() {
        let mut v: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin()).collect();
        let orig = v.clone();
        hadamard_f32(&mut v);
        let n0: f32 = orig.iter().map(|x| x * x).sum();
        let n1: f32 = v.iter().map(|x| x * x).sum();
        assert!((n0 - n1).abs() < 1e-5 * n0);
        hadamard_f32(&mut v);
        for (a, b) in v.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn top_k_breaks_ties_to_the_lower_row() {
        let s = [1.0, 3.0, 3.0, -1.0, 3.0, 2.0];
        let mut out = Vec::new();
        top_k_rows(&s, 4, &mut out);
        assert_eq!(out, [1, 2, 4, 5]);
        top_k_rows(&s, 10, &mut out);
        assert_eq!(out, [1, 2, 4, 5, 0, 3]);
        top_k_rows(&s, 0, &mut out);
        assert!(out.is_empty());
        // Signed zeros, infinities and NaNs in `total_cmp` order.
        let s = [
            0.0,
            -0.0,
            f32::NAN,
            f32::NEG_INFINITY,
            -f32::NAN,
            1.0,
            f32::INFINITY,
        ];
        top_k_rows(&s, 7, &mut out);
        assert_eq!(out, [2, 6, 5, 0, 1, 3, 4]);
    }
}
