//! Golden of the CSA layer's extra parts (`docs/dsv4.md`, "CSA layer"): the overlapping
//! ratio-4 compressor (used twice: the main compressor, `head_dim` wide, and the indexer's,
//! `index_head_dim` wide), the Hadamard transform, and the indexer that picks the top-k
//! compressed rows each token attends to.

use super::attention::CacheWrite;
use super::compress::StateWrite;
use super::{dot_i8, matvec_bf16, quant_row, rms_norm, rope, rope_cos_sin};
use crate::dsv4::config::Dsv4Config;
use crate::dsv4::fixture::{CompressorWeights, CsaParts, IndexCache, OverlapState};

/// One compressed row a step writes.
#[derive(Clone, Debug, PartialEq)]
pub struct ClosedRow {
    /// Sequence.
    pub seq: usize,
    /// Row index in the sequence's compressed cache (`(p + 1) / ratio - 1`).
    pub index: usize,
    /// The row after RMSNorm and RoPE at the window start (bf16 values after the norm; the
    /// RoPE output is not rounded here).
    pub row: Vec<f32>,
}

/// One step of an overlapping compressor. Each token writes its `[kv | score]` row
/// (`2 · width` channels each) at `seq · 2 · ratio + p % (2 · ratio)`; the token that closes
/// window `i` (`(p + 1) % ratio == 0`) pools, per output channel `c`, the previous window's
/// rows at channel `c` and this window's rows at channel `width + c` (8 candidates; window 0
/// has no previous one) with a softmax over the matching scores, then RMSNorm and RoPE at
/// the window's first position `p + 1 - ratio`.
pub fn overlap_compress_step(
    cfg: &Dsv4Config,
    w: &CompressorWeights,
    state: &OverlapState,
    x_n: &[Vec<f32>],
    positions: &[usize],
    seqs: &[usize],
    inv_freq: &[f64],
) -> (StateWrite, Vec<ClosedRow>) {
    let (ratio, width) = (state.ratio, state.width);
    let (wide, ring, rd) = (2 * width, 2 * ratio, cfg.rope_dim);
    let mut kv = state.kv.clone();
    let mut score = state.score.clone();
    let mut sw = StateWrite {
        slots: Vec::new(),
        kv: Vec::new(),
        score: Vec::new(),
    };
    let mut closed = Vec::new();
    for (t, x) in x_n.iter().enumerate() {
        let (p, b) = (positions[t], seqs[t]);
        let slot = b * ring + p % ring;
        let k = matvec_bf16(x, &w.wkv, wide);
        let g = matvec_bf16(x, &w.wgate, wide);
        let ape = &w.ape[(p % ratio) * wide..(p % ratio + 1) * wide];
        kv[slot * wide..(slot + 1) * wide].copy_from_slice(&k);
        for c in 0..wide {
            score[slot * wide + c] = g[c] + ape[c];
        }
        sw.slots.push(slot);
        sw.kv.extend_from_slice(&kv[slot * wide..(slot + 1) * wide]);
        sw.score
            .extend_from_slice(&score[slot * wide..(slot + 1) * wide]);
        if (p + 1) % ratio != 0 {
            continue;
        }
        let w0 = p + 1 - ratio;
        // (position, channel offset) of the candidates: previous window's first half, then
        // this window's second half.
        let mut cands: Vec<(usize, usize)> = Vec::with_capacity(2 * ratio);
        if w0 >= ratio {
            cands.extend((w0 - ratio..w0).map(|q| (q, 0)));
        }
        cands.extend((w0..=p).map(|q| (q, width)));
        let pooled: Vec<f32> = (0..width)
            .map(|c| {
                let at =
                    |v: &[f32], (q, off): (usize, usize)| v[(b * ring + q % ring) * wide + off + c];
                let m = cands
                    .iter()
                    .map(|&cd| at(&score, cd))
                    .fold(f32::NEG_INFINITY, f32::max);
                let (mut num, mut den) = (0.0f32, 0.0f32);
                for &cd in &cands {
                    let e = (at(&score, cd) - m).exp();
                    num += e * at(&kv, cd);
                    den += e;
                }
                num / den
            })
            .collect();
        let mut row = rms_norm(&pooled, Some(w.norm.as_slice()), cfg.rms_eps);
        rope(&mut row[width - rd..], &rope_cos_sin(inv_freq, w0));
        closed.push(ClosedRow {
            seq: b,
            index: (p + 1) / ratio - 1,
            row,
        });
    }
    (sw, closed)
}

/// The orthonormal Hadamard transform in place (Sylvester order, `/ sqrt(n)`), `n` a power of
/// two: the fast butterfly.
pub fn hadamard(v: &mut [f32]) {
    let n = v.len();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (v[j], v[j + h]);
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    v.iter_mut().for_each(|x| *x *= s);
}

/// What the indexer decided for one token.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexPick {
    /// Visible compressed rows `min(max_rows, (p + 1) / ratio)`.
    pub visible: usize,
    /// Score of every visible row.
    pub scores: Vec<f32>,
    /// The top `min(index_topk, visible)` rows, best first (ties to the lower row).
    pub selected: Vec<usize>,
}

/// The index cache as a step sees it: rows written in this step replace the cache's.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexWrite {
    /// Slot `seq · max_rows + index` of each written row.
    pub slots: Vec<usize>,
    /// `[writes, index_head_dim]` int8.
    pub q: Vec<i8>,
    /// `[writes]`.
    pub scale: Vec<f32>,
}

/// Index rows from the indexer compressor's closed rows: Hadamard, then int8 per row.
pub fn index_rows(closed: &[ClosedRow], max_rows: usize) -> IndexWrite {
    let mut iw = IndexWrite {
        slots: Vec::new(),
        q: Vec::new(),
        scale: Vec::new(),
    };
    for c in closed {
        let mut row = c.row.clone();
        hadamard(&mut row);
        let (s, q) = quant_row(&row);
        iw.slots.push(c.seq * max_rows + c.index);
        iw.q.extend(q.iter().map(|&v| v as i8));
        iw.scale.push(s);
    }
    iw
}

/// The indexer of one token: `qr_i8`/`qr_scale` its quantised `qr`, `x_n` its normed input,
/// `pos` its position, `first_pos` the step's first position of its sequence (where the
/// index queries are roped), `cache` the index cache with this step's rows applied.
#[allow(clippy::too_many_arguments)]
pub fn index_pick(
    cfg: &Dsv4Config,
    parts: &CsaParts,
    cache: &IndexCache,
    seq: usize,
    qr_scale: f32,
    qr_i8: &[i32],
    x_n: &[f32],
    pos: usize,
    first_pos: usize,
    inv_freq: &[f64],
) -> IndexPick {
    let (ih, id, rd) = (cfg.index_heads, cfg.index_head_dim, cfg.rope_dim);
    let cs = rope_cos_sin(inv_freq, first_pos);
    let heads: Vec<(f32, Vec<i32>)> = (0..ih)
        .map(|h| {
            let mut q: Vec<f32> = (0..id)
                .map(|d| {
                    let r = h * id + d;
                    dot_i8(qr_i8, parts.wq_idx.row(r)) as f32 * qr_scale * parts.wq_idx.scale[r]
                })
                .collect();
            rope(&mut q[id - rd..], &cs);
            hadamard(&mut q);
            quant_row(&q)
        })
        .collect();
    let weights: Vec<f32> = matvec_bf16(x_n, &parts.w_weights, ih)
        .iter()
        .map(|v| v * cfg.index_weight_scale())
        .collect();
    let visible = ((pos + 1) / cfg.csa_ratio).min(cache.max_rows);
    let scores: Vec<f32> = (0..visible)
        .map(|c| {
            let slot = seq * cache.max_rows + c;
            let k = &cache.q[slot * id..(slot + 1) * id];
            let s: f32 = heads
                .iter()
                .zip(&weights)
                .map(|((qs, q), w)| (dot_i8(q, k) as f32 * qs).max(0.0) * w)
                .sum();
            cache.scale[slot] * s
        })
        .collect();
    let mut order: Vec<usize> = (0..visible).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    order.truncate(cfg.index_topk.min(visible));
    IndexPick {
        visible,
        scores,
        selected: order,
    }
}

/// The CSA writes of one step.
#[derive(Clone, Debug, PartialEq)]
pub struct CsaWrites {
    /// Main compressor state rows written.
    pub state_write: StateWrite,
    /// Main compressed rows written (bf16, slot `seq · max_rows + index`, in the step's row
    /// order).
    pub compressed: CacheWrite,
    /// Indexer compressor state rows written.
    pub index_state_write: StateWrite,
    /// Index-cache rows written.
    pub index_write: IndexWrite,
    /// Each token's indexer decision.
    pub picks: Vec<IndexPick>,
}
