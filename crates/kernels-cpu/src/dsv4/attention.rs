//! Sparse attention with an attention sink over a candidate list (`docs/dsv4.md`, "SWA layer"
//! step 3): every head of a token attends to the same candidate rows (one row is K and V of
//! every head), the list taken in tiles of [`ATTN_TILE`] entries with an online softmax in
//! fp32, `o += bf16(p) @ kv`, and the sink as a logit with a zero value row:
//! `out = o / (Σ p + exp(sink − m))`.
//!
//! A candidate is `None` when masked (padding, an invalid index): it is skipped, so it changes
//! nothing; a tile with no valid row is skipped whole; a list with no valid row gives zeros.
//!
//! Both products of a tile run on [`crate::gemm_bf16`], so they take the best matrix path the
//! CPU has (AMX tiles from 16 heads, AVX-512 BF16, AVX2, portable): the scores with the
//! tile's gathered rows `[n, d]` as the weights and the heads' queries as the activations, the
//! values with the rows transposed (`[d, n]`) as the weights and the heads' `bf16(p)` as the
//! activations, accumulated into the output.

use half::bf16;

use crate::gemm::{
    GemmTile, OutMode, PackedActs, WeightsBf16, gemm_bf16, pack_acts_f32, packed_len,
};

/// Candidates per tile.
pub const ATTN_TILE: usize = 128;

/// Reusable buffers of [`sparse_attention`] (sized on first use, kept between calls).
#[derive(Debug, Default)]
pub struct AttnScratch {
    rows: Vec<bf16>,
    rows_t: Vec<bf16>,
    q_packed: Vec<f32>,
    p: Vec<f32>,
    p_packed: Vec<f32>,
    scores: Vec<f32>,
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
    s.q_packed.resize(packed_len(heads, d), 0.0);
    pack_acts_f32(q, heads, d, &mut s.q_packed);
    let mut m = vec![f32::NEG_INFINITY; heads];
    let mut l = vec![0.0f32; heads];
    for tile in cands.chunks(ATTN_TILE) {
        // Gather the tile's valid rows, and their transpose for the value product.
        s.rows.clear();
        for r in tile.iter().flatten() {
            assert_eq!(r.len(), d, "sparse_attention: candidate row len");
            s.rows.extend_from_slice(r);
        }
        let n = s.rows.len() / d;
        if n == 0 {
            continue;
        }
        s.rows_t.resize(d * n, bf16::ZERO);
        for (j, r) in s.rows.chunks_exact(d).enumerate() {
            for (c, &v) in r.iter().enumerate() {
                s.rows_t[c * n + j] = v;
            }
        }
        // scores[h, j] = q[h] · row[j]
        s.scores.resize(heads * n, 0.0);
        let rows = WeightsBf16::new(&s.rows, n, d);
        let qa = PackedActs::new(&s.q_packed, heads, d);
        gemm_bf16(rows, qa, &GemmTile::full(&rows), &mut s.scores, n);
        // Online softmax: rescale what the earlier tiles left by exp(m_old − m_new).
        s.p.resize(heads * n, 0.0);
        for h in 0..heads {
            let sc = &mut s.scores[h * n..(h + 1) * n];
            let mut mt = m[h];
            for v in sc.iter_mut() {
                *v *= scale;
                mt = mt.max(*v);
            }
            let alpha = (m[h] - mt).exp();
            m[h] = mt;
            let mut sum = 0.0f32;
            for (p, &v) in s.p[h * n..(h + 1) * n].iter_mut().zip(sc.iter()) {
                let e = (v - mt).exp();
                sum += e;
                *p = crate::convert::f32_to_bf16(e).to_f32();
            }
            l[h] = l[h] * alpha + sum;
            if alpha != 1.0 {
                out[h * d..(h + 1) * d].iter_mut().for_each(|o| *o *= alpha);
            }
        }
        // out[h] += bf16(p[h]) @ rows
        s.p_packed.resize(packed_len(heads, n), 0.0);
        pack_acts_f32(&s.p, heads, n, &mut s.p_packed);
        let rows_t = WeightsBf16::new(&s.rows_t, d, n);
        let pa = PackedActs::new(&s.p_packed, heads, n);
        let tile = GemmTile {
            n: 0..d,
            k: 0..n,
            mode: OutMode::Add,
        };
        gemm_bf16(rows_t, pa, &tile, out, d);
    }
    for h in 0..heads {
        if m[h] == f32::NEG_INFINITY {
            continue; // no valid candidate: zeros
        }
        let denom = l[h] + (sinks[h] - m[h]).exp();
        out[h * d..(h + 1) * d].iter_mut().for_each(|o| *o /= denom);
    }
}
