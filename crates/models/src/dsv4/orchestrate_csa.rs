//! The CSA layer's own part of the decode step's task graph (golden: `golden/csa.rs`,
//! `golden/attention.rs` `csa_parts`), submitted by [`super::orchestrate`] between the
//! projections of `x_n` and the attention:
//! ```text
//! 1 projections (SPMD cols, bf16)   x_n @ Wc_kvᵀ, x_n @ Wc_gateᵀ -> [T, 2·hd]   (main)
//!                                   x_n @ Wi_kvᵀ, x_n @ Wi_gateᵀ -> [T, 2·ihd]  (indexer)
//!                                   x_n @ W_wᵀ -> head weights [T, IH]
//! 2 csa_index_q (SPMD heads, W8A8)  the query projection's int8 qr @ W_idxᵀ, RoPE at the
//!                                   sequence's first position, Hadamard, int8
//!                                   -> q_i8 [T, IH·ihd], q_scale
//! 3 csa_compress main / indexer     ring rows; closed windows -> compressed rows (bf16) /
//!                                   index rows (int8 + scale)
//!   csa_scores (SPMD (seq, chunk))  int8 scores of the visible index rows -> scores
//!   csa_plan (SPMD tokens)          top-k -> each token's compressed candidate list
//! ```
//! Then the attention (phase 4) reads the window list, the planned compressed list and the
//! main compressed cache. Every edge is a tracked tensor: the rings and caches are `InOut`
//! of the compress tasks, the index cache `In` of the scores, the list `Out` of the plan and
//! `In` of the attention tasks.

use simpler_core::{DType, Orchestrator, RunArgs, RunError, Task, Tensor};
use simpler_kernels_cpu::dsv4::plan::CandidateLayout;

use super::config::Dsv4Config;
use super::ops;

type R<T> = Result<T, RunError>;

/// Compressed rows scored per block of the scores task.
pub(crate) const SCORE_CHUNK: usize = 256;

/// RunArgs indices of the CSA weights, after the layer's common ones (`buf::WEIGHTS` of
/// them); `WEIGHTS_CSA` in all.
pub(crate) mod buf {
    use super::super::orchestrate::buf::WEIGHTS;
    pub(crate) const C_WKV: usize = WEIGHTS;
    pub(crate) const C_WGATE: usize = WEIGHTS + 1;
    pub(crate) const C_APE: usize = WEIGHTS + 2;
    pub(crate) const C_NORM: usize = WEIGHTS + 3;
    pub(crate) const I_WKV: usize = WEIGHTS + 4;
    pub(crate) const I_WGATE: usize = WEIGHTS + 5;
    pub(crate) const I_APE: usize = WEIGHTS + 6;
    pub(crate) const I_NORM: usize = WEIGHTS + 7;
    pub(crate) const W_IDX: usize = WEIGHTS + 8;
    pub(crate) const W_IDX_SCALE: usize = WEIGHTS + 9;
    pub(crate) const W_W: usize = WEIGHTS + 10;
    /// Weight buffers of a CSA layer.
    pub(crate) const WEIGHTS_CSA: usize = WEIGHTS + 11;
    /// Cache buffers after the window cache: main ring kv and scores, compressed cache,
    /// indexer ring kv and scores, index rows, index scales.
    pub(crate) const CACHES: usize = 7;
}

/// The CSA layer's bound weights and caches.
pub(crate) struct CsaViews {
    wkv: Tensor,
    wgate: Tensor,
    ape: Tensor,
    norm: Tensor,
    i_wkv: Tensor,
    i_wgate: Tensor,
    i_ape: Tensor,
    i_norm: Tensor,
    w_idx: Tensor,
    w_idx_scale: Tensor,
    w_w: Tensor,
    ring_kv: Tensor,
    ring_score: Tensor,
    /// The main compressed cache `[batch · rows, hd]` bf16 (the attention reads it).
    pub(crate) cache: Tensor,
    i_ring_kv: Tensor,
    i_ring_score: Tensor,
    index_q: Tensor,
    index_scale: Tensor,
}

/// Candidate slots per token of the planned compressed list (the top-k, padded to tiles).
pub(crate) fn comp_width(cfg: &Dsv4Config) -> usize {
    CandidateLayout::new(0, cfg.index_topk).len()
}

/// Binds the CSA weights and its caches (`caches0`: the RunArgs index of the first cache
/// after the window cache).
pub(crate) fn bind(
    o: &mut Orchestrator,
    a: &RunArgs,
    cfg: &Dsv4Config,
    batch: usize,
    rows: usize,
    caches0: usize,
) -> R<CsaViews> {
    let u = |v: usize| v as u64;
    let (d, hd, ihd) = (u(cfg.hidden), u(cfg.head_dim), u(cfg.index_head_dim));
    let (ih, ql, ratio) = (u(cfg.index_heads), u(cfg.q_lora_rank), u(cfg.csa_ratio));
    let ring = u(batch) * 2 * ratio;
    let cache_rows = u(batch * rows);
    let b = &a.buffers;
    let mut bind = |i: usize, dt: DType, shape: &[u64]| o.bind(&b[i], dt, shape);
    Ok(CsaViews {
        wkv: bind(buf::C_WKV, DType::BF16, &[2 * hd, d])?,
        wgate: bind(buf::C_WGATE, DType::BF16, &[2 * hd, d])?,
        ape: bind(buf::C_APE, DType::F32, &[ratio, 2 * hd])?,
        norm: bind(buf::C_NORM, DType::F32, &[hd])?,
        i_wkv: bind(buf::I_WKV, DType::BF16, &[2 * ihd, d])?,
        i_wgate: bind(buf::I_WGATE, DType::BF16, &[2 * ihd, d])?,
        i_ape: bind(buf::I_APE, DType::F32, &[ratio, 2 * ihd])?,
        i_norm: bind(buf::I_NORM, DType::F32, &[ihd])?,
        w_idx: bind(buf::W_IDX, DType::I8, &[ih * ihd, ql])?,
        w_idx_scale: bind(buf::W_IDX_SCALE, DType::F32, &[ih * ihd])?,
        w_w: bind(buf::W_W, DType::BF16, &[ih, d])?,
        ring_kv: bind(caches0, DType::F32, &[ring, 2 * hd])?,
        ring_score: bind(caches0 + 1, DType::F32, &[ring, 2 * hd])?,
        cache: bind(caches0 + 2, DType::BF16, &[cache_rows, hd])?,
        i_ring_kv: bind(caches0 + 3, DType::F32, &[ring, 2 * ihd])?,
        i_ring_score: bind(caches0 + 4, DType::F32, &[ring, 2 * ihd])?,
        index_q: bind(caches0 + 5, DType::I8, &[cache_rows, ihd])?,
        index_scale: bind(caches0 + 6, DType::F32, &[cache_rows])?,
    })
}

/// The step's tensors the CSA part reads and writes besides its own.
pub(crate) struct CsaIo<'a> {
    /// `x_n` packed `[T, ld(D)]`.
    pub(crate) xn: &'a Tensor,
    /// `qr` normed and quantised per row (`[T, q_lora]` i8) and its scales (`[T, 1]`), as
    /// the query projection reads them.
    pub(crate) qr_i8: &'a Tensor,
    pub(crate) qr_scale: &'a Tensor,
    /// Token table, RoPE tables (host-written).
    pub(crate) tok: &'a Tensor,
    pub(crate) cos: &'a Tensor,
    pub(crate) sin: &'a Tensor,
    /// The planned compressed candidate lists `[T, comp_width]` i32 (written here).
    pub(crate) comp: &'a Tensor,
}

/// Submits the CSA tasks of one step (phases 1–3 above). `tokens` rows, `batch`
/// sequences of `rows` compressed rows each, `blocks` SPMD blocks per projection.
#[allow(clippy::too_many_arguments)]
pub(crate) fn submit(
    o: &mut Orchestrator,
    cfg: &Dsv4Config,
    cv: &CsaViews,
    io: &CsaIo<'_>,
    tokens: usize,
    batch: usize,
    rows: usize,
    blocks: u32,
    projection: impl Fn(&mut Orchestrator, &Tensor, &Tensor, &Tensor, usize, u32) -> R<()>,
) -> R<()> {
    let u = |v: usize| v as u64;
    let (d, hd, ihd, ih) = (
        cfg.hidden,
        cfg.head_dim,
        cfg.index_head_dim,
        cfg.index_heads,
    );
    let t_n = u(tokens);
    // 1: the compressors' and the head weights' projections.
    let cols = |n: usize| blocks.min(u32::try_from(n / 16).unwrap_or(1).max(1));
    let proj = |o: &mut Orchestrator, w: &Tensor, n: usize| -> R<Tensor> {
        let out = o.alloc(DType::F32, &[t_n, u(n)])?;
        projection(o, io.xn, w, &out, d, cols(n))?;
        Ok(out)
    };
    let ckv = proj(o, &cv.wkv, 2 * hd)?;
    let cgate = proj(o, &cv.wgate, 2 * hd)?;
    let ikv = proj(o, &cv.i_wkv, 2 * ihd)?;
    let igate = proj(o, &cv.i_wgate, 2 * ihd)?;
    let wts = proj(o, &cv.w_w, ih)?;
    // 2: the indexer's query heads, a block of whole heads per SPMD block.
    let q_i8 = o.alloc(DType::I8, &[t_n, u(ih * ihd)])?;
    let q_scale = o.alloc(DType::F32, &[t_n, u(ih)])?;
    // SAFETY: `W_idx` and its scales, the host-written token table and the RoPE tables are
    // written by no task during the run.
    let t = unsafe {
        Task::new(ops::CSA_INDEX_Q)
            .input(io.qr_i8)
            .input(io.qr_scale)
            .no_dep(&cv.w_idx)
            .no_dep(&cv.w_idx_scale)
            .no_dep(io.tok)
            .no_dep(io.cos)
            .no_dep(io.sin)
    }
    .output_existing(&q_i8)
    .output_existing(&q_scale)
    .scalar(u(ihd))
    .blocks(blocks.min(u32::try_from(ih).unwrap_or(u32::MAX)))
    .timing_slot(2);
    o.submit(t)?;
    // 3: both compressors.
    for (kv, gate, ape, norm, rkv, rscore, out) in [
        (
            &ckv,
            &cgate,
            &cv.ape,
            &cv.norm,
            &cv.ring_kv,
            &cv.ring_score,
            &[&cv.cache][..],
        ),
        (
            &ikv,
            &igate,
            &cv.i_ape,
            &cv.i_norm,
            &cv.i_ring_kv,
            &cv.i_ring_score,
            &[&cv.index_q, &cv.index_scale][..],
        ),
    ] {
        // SAFETY: `ape`, the norm weight and the host tables are written by no task.
        let mut t = unsafe {
            Task::new(ops::CSA_COMPRESS)
                .input(kv)
                .input(gate)
                .no_dep(ape)
                .no_dep(norm)
                .no_dep(io.tok)
                .no_dep(io.cos)
                .no_dep(io.sin)
        }
        .in_out(rkv)
        .in_out(rscore);
        for c in out {
            t = t.in_out(c);
        }
        let t = t
            .scalar(u(cfg.csa_ratio))
            .scalar(u(rows))
            .scalar_f32(cfg.rms_eps)
            .timing_slot(3);
        o.submit(t)?;
    }
    // 3: the scores of every visible index row, then each token's top-k as its list.
    let chunks = rows.div_ceil(SCORE_CHUNK);
    let per_seq = tokens / batch.max(1);
    let scores = o.alloc(DType::F32, &[u(batch * chunks * per_seq), u(SCORE_CHUNK)])?;
    // SAFETY: the host-written token table is written by no task.
    let t = unsafe {
        Task::new(ops::CSA_SCORES)
            .input(&q_i8)
            .input(&q_scale)
            .input(&wts)
            .no_dep(io.tok)
    }
    .input(&cv.index_q)
    .input(&cv.index_scale)
    .output_existing(&scores)
    .scalar(u(cfg.csa_ratio))
    .scalar(u(rows))
    .scalar(u(SCORE_CHUNK))
    .scalar_f32(cfg.index_weight_scale())
    .blocks(u32::try_from(batch * chunks).unwrap_or(u32::MAX))
    .timing_slot(3);
    o.submit(t)?;
    // SAFETY: the host-written token table is written by no task.
    let t = unsafe { Task::new(ops::CSA_PLAN).input(&scores).no_dep(io.tok) }
        .output_existing(io.comp)
        .scalar(u(cfg.csa_ratio))
        .scalar(u(rows))
        .scalar(u(SCORE_CHUNK))
        .scalar(u(cfg.index_topk))
        .blocks(u32::try_from(tokens).unwrap_or(u32::MAX))
        .timing_slot(3);
    o.submit(t)?;
    Ok(())
}
