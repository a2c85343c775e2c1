//! The CSA layer's own kernels (`docs/dsv4.md`, "CSA layer"): the overlapping ratio-4
//! compressors (state rows into each sequence's ring, the pooled row of a token that closes a
//! window, written as a bf16 KV row or as an int8 index row), the indexer's query heads (the
//! W8A8 `W_idx` projection of the token's `qr`, RoPE at the step's first position, Hadamard,
//! int8), the int8 scores of the visible compressed rows, and the planning task (each token's
//! top-k compressed rows as its candidate list).

use half::bf16;
use simpler_core::{KernelError, TaskCtx};
use simpler_kernels_cpu as kc;
use simpler_kernels_cpu::dsv4::csa::{
    IndexQueries, Overlap, index_query_i8, index_row_i8, index_scores, overlap_pool_row,
    overlap_state_write, top_k_rows,
};
use simpler_kernels_cpu::dsv4::plan::{CandidateLayout, plan_token};
use simpler_kernels_cpu::{GemmTile, OutMode, WeightsI8};

use crate::dsv4::int8_layout::{Int8Use, kernel_layout};

use super::{bad, check_len, dims2, rope_rows, token};

/// `CSA_COMPRESS` argument indices (the main compressor ends with `CACHE`, the indexer's with
/// `INDEX_Q`, `INDEX_SCALE`).
pub(crate) mod compress {
    pub(crate) const KV: usize = 0;
    pub(crate) const GATE: usize = 1;
    pub(crate) const APE: usize = 2;
    pub(crate) const NORM: usize = 3;
    pub(crate) const TOK: usize = 4;
    pub(crate) const COS: usize = 5;
    pub(crate) const SIN: usize = 6;
    pub(crate) const RING_KV: usize = 7;
    pub(crate) const RING_SCORE: usize = 8;
    pub(crate) const CACHE: usize = 9;
    pub(crate) const INDEX_Q: usize = 9;
    pub(crate) const INDEX_SCALE: usize = 10;
}

/// `CSA_INDEX_Q` argument indices.
pub(crate) mod index_q {
    pub(crate) const QI8: usize = 0;
    pub(crate) const QS: usize = 1;
    pub(crate) const W: usize = 2;
    pub(crate) const SCALES: usize = 3;
    pub(crate) const TOK: usize = 4;
    pub(crate) const COS: usize = 5;
    pub(crate) const SIN: usize = 6;
    pub(crate) const Q_I8: usize = 7;
    pub(crate) const Q_SCALE: usize = 8;
}

/// `CSA_SCORES` argument indices.
pub(crate) mod scores {
    pub(crate) const Q_I8: usize = 0;
    pub(crate) const Q_SCALE: usize = 1;
    pub(crate) const WEIGHTS: usize = 2;
    pub(crate) const TOK: usize = 3;
    pub(crate) const INDEX_Q: usize = 4;
    pub(crate) const INDEX_SCALE: usize = 5;
    pub(crate) const SCORES: usize = 6;
}

/// `CSA_PLAN` argument indices.
pub(crate) mod plan {
    pub(crate) const SCORES: usize = 0;
    pub(crate) const TOK: usize = 1;
    pub(crate) const COMP: usize = 2;
}

/// The RoPE table's pair count (`[positions, pairs]`).
fn rope_pairs(ctx: &TaskCtx<'_>, i: usize) -> Result<usize, KernelError> {
    Ok(dims2(ctx, i)?.1)
}

/// Visible compressed rows of a token at `pos`: `min(max_rows, (pos + 1) / ratio)`.
fn visible(pos: usize, ratio: usize, max_rows: usize) -> usize {
    ((pos + 1) / ratio).min(max_rows)
}

/// The first token and token count of sequence `seq` in `tok` (its tokens must be adjacent
/// rows, the step's layout), and its first position.
fn seq_tokens(
    kernel: &str,
    tok: &[u32],
    rows: usize,
    seq: usize,
) -> Result<(usize, usize, usize), KernelError> {
    let mut first = None;
    let mut n = 0;
    let mut pos0 = usize::MAX;
    for t in 0..rows {
        let (s, pos, _) = token(kernel, tok, t)?;
        if s != seq {
            continue;
        }
        match first {
            None => first = Some(t),
            Some(f) if f + n != t => {
                return Err(bad(
                    kernel,
                    format!("sequence {seq}'s tokens are not adjacent rows"),
                ));
            }
            Some(_) => {}
        }
        n += 1;
        pos0 = pos0.min(pos);
    }
    Ok((first.unwrap_or(0), n, pos0))
}

/// One overlapping compressor over the step's tokens, in row order: each writes its state row
/// into its sequence's ring; a token closing a window pools, norms and ropes the window's row
/// and writes it (main: bf16 into the compressed cache; indexer: Hadamard, int8 and scale
/// into the index cache) at row `seq · max_rows + (pos + 1) / ratio − 1`.
pub(super) fn csa_compress(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_csa_compress";
    let ratio = ctx.scalar_usize(0)?;
    let max_rows = ctx.scalar_usize(1)?;
    let eps = ctx.scalar_f32(2)?;
    let index = ctx.num_args() > compress::INDEX_SCALE;
    let (rows, wide) = dims2(ctx, compress::KV)?;
    let kv = ctx.read::<f32>(compress::KV)?;
    let gate = ctx.read::<f32>(compress::GATE)?;
    let ape = ctx.read::<f32>(compress::APE)?;
    let norm = ctx.read::<f32>(compress::NORM)?;
    let tok = ctx.read::<u32>(compress::TOK)?;
    let (cos, sin) = (
        ctx.read::<f32>(compress::COS)?,
        ctx.read::<f32>(compress::SIN)?,
    );
    let pairs = rope_pairs(ctx, compress::COS)?;
    let ov = Overlap {
        ratio,
        width: wide / 2,
    };
    if ratio == 0 || wide == 0 || !wide.is_multiple_of(2) || 2 * pairs > ov.width {
        return Err(bad(
            NAME,
            format!("ratio {ratio}, state rows of {wide}, {pairs} RoPE pairs"),
        ));
    }
    check_len(NAME, "gate", gate.len(), rows * wide)?;
    check_len(NAME, "ape", ape.len(), ratio * wide)?;
    check_len(NAME, "norm", norm.len(), ov.width)?;
    let ring_kv = ctx.write::<f32>(compress::RING_KV)?;
    let ring_score = ctx.write::<f32>(compress::RING_SCORE)?;
    check_len(NAME, "ring scores", ring_score.len(), ring_kv.len())?;
    if !ring_kv.len().is_multiple_of(ov.ring_len()) {
        return Err(bad(
            NAME,
            format!(
                "ring holds {} floats, not whole rings of {}",
                ring_kv.len(),
                ov.ring_len()
            ),
        ));
    }
    let seqs = ring_kv.len() / ov.ring_len();
    let mut main_cache: Option<&mut [bf16]> = None;
    let mut index_cache: Option<(&mut [i8], &mut [f32])> = None;
    let cache_rows = if index {
        let (r, w) = dims2(ctx, compress::INDEX_Q)?;
        let q = ctx.write::<i8>(compress::INDEX_Q)?;
        let s = ctx.write::<f32>(compress::INDEX_SCALE)?;
        check_len(NAME, "index scales", s.len(), r)?;
        check_len(NAME, "index row width", w, ov.width)?;
        index_cache = Some((q, s));
        r
    } else {
        let (r, w) = dims2(ctx, compress::CACHE)?;
        check_len(NAME, "compressed row width", w, ov.width)?;
        main_cache = Some(ctx.write::<bf16>(compress::CACHE)?);
        r
    };
    if cache_rows != seqs * max_rows {
        return Err(bad(
            NAME,
            format!("cache of {cache_rows} rows for {seqs} sequences of {max_rows}"),
        ));
    }
    let mut row = vec![0.0f32; ov.width];
    for t in 0..rows {
        let (seq, pos, write) = token(NAME, tok, t)?;
        if write.is_none() {
            continue;
        }
        if seq >= seqs {
            return Err(bad(
                NAME,
                format!("sequence {seq} outside the {seqs} rings"),
            ));
        }
        let ring = seq * ov.ring_len()..(seq + 1) * ov.ring_len();
        overlap_state_write(
            ov,
            pos,
            &kv[t * wide..(t + 1) * wide],
            &gate[t * wide..(t + 1) * wide],
            ape,
            &mut ring_kv[ring.clone()],
            &mut ring_score[ring.clone()],
        );
        if !ov.closes(pos) {
            continue;
        }
        let w0 = pos + 1 - ratio;
        let i = (pos + 1) / ratio - 1;
        if i >= max_rows {
            return Err(bad(
                NAME,
                format!("compressed row {i} of sequence {seq} past the cache's {max_rows}"),
            ));
        }
        let (c, s) = rope_rows(NAME, cos, sin, pairs, w0)?;
        overlap_pool_row(
            ov,
            &ring_kv[ring.clone()],
            &ring_score[ring],
            w0,
            norm,
            eps,
            c,
            s,
            &mut row,
        );
        let r = seq * max_rows + i;
        let w = ov.width;
        if let Some(cache) = main_cache.as_deref_mut() {
            kc::cast_f32_bf16(&row, &mut cache[r * w..(r + 1) * w]);
        }
        if let Some((q, scale)) = index_cache.as_mut() {
            scale[r] = index_row_i8(&mut row, &mut q[r * w..(r + 1) * w]);
        }
    }
    Ok(())
}

/// The indexer's query heads, SPMD over heads: `qr` normed and quantised per row as the query
/// projection does, this block's heads of `qr_i8 @ W_idxᵀ` (W8A8), then per head RoPE at the
/// sequence's first position in the step, Hadamard and int8 (`q_i8`, `q_scale`).
pub(super) fn csa_index_q(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_csa_index_q";
    let hd = ctx.scalar_usize(0)?;
    let (rows, ql) = dims2(ctx, index_q::QI8)?;
    // The token's int8 `qr`, the same the query projection (`Q_B`) reads.
    let xq = ctx.read::<i8>(index_q::QI8)?;
    let xs = ctx.read::<f32>(index_q::QS)?;
    let (wrows, wcols) = dims2(ctx, index_q::W)?;
    let w = ctx.read::<i8>(index_q::W)?;
    let scales = ctx.read::<f32>(index_q::SCALES)?;
    let tok = ctx.read::<u32>(index_q::TOK)?;
    let (cos, sin) = (
        ctx.read::<f32>(index_q::COS)?,
        ctx.read::<f32>(index_q::SIN)?,
    );
    let pairs = rope_pairs(ctx, index_q::COS)?;
    check_len(NAME, "W_idx scales", scales.len(), wrows)?;
    if wcols != ql || !hd.is_power_of_two() || !wrows.is_multiple_of(hd) || 2 * pairs > hd {
        return Err(bad(
            NAME,
            format!("W_idx [{wrows}, {wcols}] for q_lora {ql}, heads of {hd}"),
        ));
    }
    let heads = wrows / hd;
    let mut q_out = ctx.write_block_cols::<i8>(index_q::Q_I8, hd)?;
    let mut s_out = ctx.write_block_cols::<f32>(index_q::Q_SCALE, 1)?;
    if q_out.len() != rows || q_out.view_row_len() != wrows {
        return Err(bad(NAME, "q_i8 is not [tokens, heads · head_dim]"));
    }
    if s_out.len() != rows || s_out.view_row_len() != heads {
        return Err(bad(NAME, "q_scale is not [tokens, heads]"));
    }
    let (c0, n) = (q_out.first_col(), q_out.row_len());
    if s_out.first_col() * hd != c0 || s_out.row_len() * hd != n {
        return Err(bad(NAME, "q_i8 and q_scale blocks disagree"));
    }
    if n == 0 {
        return Ok(());
    }
    let acts = super::attn::acts_i8(NAME, xq, xs, rows, ql)?;
    let wi = WeightsI8::with_layout(
        w,
        scales,
        wrows,
        ql,
        kernel_layout(Int8Use::Attention { rows }),
    )
    .rows_range(c0..c0 + n);
    let mut out = vec![0.0f32; rows * n];
    let tile = GemmTile {
        n: 0..n,
        k: 0..ql,
        mode: OutMode::Store,
    };
    kc::gemm_i8_w8a8(wi, acts, &tile, &mut out, n);
    let mut qi = vec![0i8; n];
    let mut qs = vec![0.0f32; n / hd];
    for (t, o) in out.chunks_exact_mut(n).enumerate() {
        let (seq, _, _) = token(NAME, tok, t)?;
        let (_, _, first) = seq_tokens(NAME, tok, rows, seq)?;
        let (c, s) = rope_rows(NAME, cos, sin, pairs, first)?;
        index_query_i8(o, hd, c, s, &mut qi, &mut qs);
        q_out.row(t).copy_from_slice(&qi);
        s_out.row(t).copy_from_slice(&qs);
    }
    Ok(())
}

/// Index scores, SPMD over (sequence, chunk of `chunk` compressed rows): block `i` scores
/// rows `c · chunk ..` (up to the most any token of the sequence sees) for every token of
/// sequence `i / chunks` into its chunk of `scores` `[seqs, chunks, tokens per sequence,
/// chunk]`. Head weights are `weights · weight_scale`.
pub(super) fn csa_scores(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_csa_scores";
    let ratio = ctx.scalar_usize(0)?;
    let max_rows = ctx.scalar_usize(1)?;
    let chunk = ctx.scalar_usize(2)?;
    let weight_scale = ctx.scalar_f32(3)?;
    let (rows, qw) = dims2(ctx, scores::Q_I8)?;
    let q = ctx.read::<i8>(scores::Q_I8)?;
    let (_, heads) = dims2(ctx, scores::Q_SCALE)?;
    let q_scale = ctx.read::<f32>(scores::Q_SCALE)?;
    let weights = ctx.read::<f32>(scores::WEIGHTS)?;
    let tok = ctx.read::<u32>(scores::TOK)?;
    let (cache_rows, hd) = dims2(ctx, scores::INDEX_Q)?;
    let keys = ctx.read::<i8>(scores::INDEX_Q)?;
    let key_scale = ctx.read::<f32>(scores::INDEX_SCALE)?;
    check_len(NAME, "q_scale", q_scale.len(), rows * heads)?;
    check_len(NAME, "weights", weights.len(), rows * heads)?;
    check_len(NAME, "index scales", key_scale.len(), cache_rows)?;
    if ratio == 0 || chunk == 0 || max_rows == 0 || heads * hd != qw {
        return Err(bad(
            NAME,
            format!("ratio {ratio}, chunk {chunk}, {heads} heads of {hd} for queries of {qw}"),
        ));
    }
    if !cache_rows.is_multiple_of(max_rows) {
        return Err(bad(
            NAME,
            format!("index cache of {cache_rows} rows for sequences of {max_rows}"),
        ));
    }
    let (seqs, chunks) = (cache_rows / max_rows, max_rows.div_ceil(chunk));
    let per_seq = rows / seqs.max(1);
    let out = ctx.write_chunk::<f32>(scores::SCORES, per_seq * chunk)?;
    if ctx.block_num() != seqs * chunks || rows != per_seq * seqs {
        return Err(bad(
            NAME,
            format!(
                "{} blocks, {rows} tokens for {seqs} sequences x {chunks} chunks",
                ctx.block_num()
            ),
        ));
    }
    check_len(NAME, "scores chunk", out.len(), per_seq * chunk)?;
    let (seq, c) = (ctx.block_idx() / chunks, ctx.block_idx() % chunks);
    let (t0, n, _) = seq_tokens(NAME, tok, rows, seq)?;
    if n != per_seq {
        return Err(bad(
            NAME,
            format!("sequence {seq} has {n} tokens, expected {per_seq}"),
        ));
    }
    let mut most = 0;
    for t in t0..t0 + n {
        let (_, pos, _) = token(NAME, tok, t)?;
        most = most.max(visible(pos, ratio, max_rows));
    }
    let lo = (c * chunk).min(most);
    let hi = ((c + 1) * chunk).min(most);
    let w: Vec<f32> = weights[t0 * heads..(t0 + n) * heads]
        .iter()
        .map(|v| v * weight_scale)
        .collect();
    let first = seq * max_rows;
    index_scores(
        IndexQueries {
            q: &q[t0 * qw..(t0 + n) * qw],
            scale: &q_scale[t0 * heads..(t0 + n) * heads],
            weight: &w,
            tokens: n,
            heads,
            head_dim: hd,
        },
        &keys[first * hd..(first + max_rows) * hd],
        &key_scale[first..first + max_rows],
        lo..hi,
        out,
        chunk,
    );
    Ok(())
}

/// The planning task, SPMD over tokens: each token's visible scores gathered from the
/// chunks, its top `topk` rows (best first, ties to the lower row) written as compressed-cache
/// rows `seq · max_rows + r` into its candidate row of `comp` `[tokens, C]` (`C` whole
/// attention tiles), the rest masked.
pub(super) fn csa_plan(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_csa_plan";
    let ratio = ctx.scalar_usize(0)?;
    let max_rows = ctx.scalar_usize(1)?;
    let chunk = ctx.scalar_usize(2)?;
    let topk = ctx.scalar_usize(3)?;
    let scores = ctx.read::<f32>(plan::SCORES)?;
    let tok = ctx.read::<u32>(plan::TOK)?;
    let mut comp = ctx.write_block_rows::<i32>(plan::COMP)?;
    let cols = comp.row_len();
    let layout = CandidateLayout::new(0, topk);
    if ratio == 0 || chunk == 0 || max_rows == 0 || cols != layout.len() {
        return Err(bad(
            NAME,
            format!("ratio {ratio}, chunk {chunk}, candidate rows of {cols} for top-{topk}"),
        ));
    }
    let chunks = max_rows.div_ceil(chunk);
    let rows = tok.len() / super::TOK_COLS;
    let mut picked = Vec::with_capacity(topk);
    let mut valid = vec![0u32; layout.tiles()];
    for i in 0..comp.len() {
        let t = comp.first_row() + i;
        let (seq, pos, _) = token(NAME, tok, t)?;
        let (t0, per_seq, _) = seq_tokens(NAME, tok, rows, seq)?;
        let seqs = rows / per_seq.max(1);
        check_len(
            NAME,
            "scores",
            scores.len(),
            seqs * chunks * per_seq * chunk,
        )?;
        if seq >= seqs {
            return Err(bad(
                NAME,
                format!("sequence {seq} outside the {seqs} sequences of the step"),
            ));
        }
        let vis = visible(pos, ratio, max_rows);
        let s = t - t0;
        let mine: Vec<f32> = (0..chunks)
            .flat_map(|c| {
                let o = ((seq * chunks + c) * per_seq + s) * chunk;
                scores[o..o + chunk].iter().copied()
            })
            .take(vis)
            .collect();
        top_k_rows(&mine, topk, &mut picked);
        for r in picked.iter_mut() {
            *r += (seq * max_rows) as u32;
        }
        plan_token(layout, &[], &picked, comp.row(i), &mut valid);
    }
    Ok(())
}
