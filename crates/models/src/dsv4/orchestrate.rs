//! The SWA and HCA decode step as a task graph (golden: `golden/attention.rs`,
//! `attention_step`; `golden/compress.rs`). `T` tokens, `H` heads of `hd`, one timing slot
//! per phase (the slot is the phase's index below):
//! ```text
//! 0 hc_mix (SPMD mix rows)         x_hc @ mixᵀ -> dots [T, hc_mix] (each mix row read once)
//!   hc_pre (SPMD rows)             dots, x_hc -> hcw [T, hc_mix], x_n packed [T, ld(D)]
//! 1 projections (SPMD cols, bf16)  x_n @ Wq_aᵀ -> qr [T, q_lora]; x_n @ Wkvᵀ -> kv [T, hd]
//!                                  HCA: x_n @ Wc_kvᵀ, x_n @ Wc_gateᵀ -> c_kv, c_score [T, hd]
//! 2 act_i8 (SPMD rows)            norm, int8 per row -> qr_i8 [T, q_lora], scales (once)
//!   q_b (SPMD heads, W8A8)         qr_i8 @ Wq_bᵀ, head norm, RoPE -> q [T, H·hd]
//! 3 kv_write                       norm, RoPE, bf16 -> window cache rows
//!   HCA compress                   state rows; pooled rows of closed windows -> compressed cache
//! 4 attention per (token, heads)   window list (+ compressed list) -> attn [T, H·hd]
//! 5 wo_a (SPMD cols, bf16)         attn[g] @ Wo_a[g]ᵀ -> o_r [T, G·o_lora]
//! 6 act_i8 (SPMD rows)            int8 per (token, group) -> o_r_i8, scales [T, G] (once)
//!   wo_b (SPMD cols, W8A8)         o_r_i8 @ Wo_bᵀ per group, bf16 -> y [T, D]
//! 7 hc_post (SPMD rows)            -> x_out [T, hc·D]
//! ```
//! A CSA step adds its compressors, indexer and planning task ([`super::orchestrate_csa`]:
//! phases 1–3, the scores and the top-k in phase 3) and passes the planned compressed lists to
//! the attention.
//! Every edge is a tracked tensor: the caches are `InOut` of the tasks that write them and
//! `In` of the attention tasks, so attention waits for the step's own rows.

use simpler_core::{DType, Orchestrator, RunArgs, RunError, Task, Tensor, TensorError};
use simpler_kernels_cpu::dsv4::hc_mix_len;
use simpler_kernels_cpu::packed_ld;

use super::config::{Dsv4Config, LayerKind};
use super::ops;
use super::orchestrate_csa;
use super::runner::AttnTiles;
use crate::qwen3::ops::GEMM_TILE;
use crate::qwen3::ops::scalars::{GemmScalars, PushScalars};

/// RunArgs buffer indices: the weights and tables, then (after `WEIGHTS` or `WEIGHTS_HCA` of
/// them) the window cache, the HCA caches, and the step's I/O.
pub(crate) mod buf {
    pub(crate) const HC_MIX: usize = 0;
    pub(crate) const HC_BASE: usize = 1;
    pub(crate) const ATTN_NORM: usize = 2;
    pub(crate) const WQ_A: usize = 3;
    pub(crate) const Q_NORM: usize = 4;
    pub(crate) const WQ_B: usize = 5;
    pub(crate) const WQ_B_SCALE: usize = 6;
    pub(crate) const WKV: usize = 7;
    pub(crate) const KV_NORM: usize = 8;
    pub(crate) const WO_A: usize = 9;
    pub(crate) const WO_B: usize = 10;
    pub(crate) const WO_B_SCALE: usize = 11;
    pub(crate) const SINK: usize = 12;
    pub(crate) const COS: usize = 13;
    pub(crate) const SIN: usize = 14;
    /// Weight buffers of an SWA layer.
    pub(crate) const WEIGHTS: usize = 15;
    pub(crate) const C_WKV: usize = 15;
    pub(crate) const C_WGATE: usize = 16;
    pub(crate) const C_APE: usize = 17;
    pub(crate) const C_NORM: usize = 18;
    /// Weight buffers of an HCA layer.
    pub(crate) const WEIGHTS_HCA: usize = 19;
}

/// The step's I/O buffers, after the weights and caches: the host-written token table and
/// candidate lists and the residual in; the roped queries, the attention output, the
/// projected output (the golden's intermediates) and the new residual out.
pub(crate) mod io {
    pub(crate) const TOK: usize = 0;
    pub(crate) const WIN: usize = 1;
    pub(crate) const COMP: usize = 2;
    pub(crate) const X: usize = 3;
    pub(crate) const Q: usize = 4;
    pub(crate) const ATTN: usize = 5;
    pub(crate) const Y: usize = 6;
    pub(crate) const X_OUT: usize = 7;
    pub(crate) const COUNT: usize = 8;
}

/// Everything the graph needs about one step, computed on the host.
#[derive(Clone, Debug)]
pub(crate) struct AttnPlan {
    pub(crate) config: Dsv4Config,
    pub(crate) kind: LayerKind,
    pub(crate) tokens: usize,
    pub(crate) batch: usize,
    pub(crate) window_slots: usize,
    /// Compressed candidates per token (0 for SWA).
    pub(crate) comp_width: usize,
    /// Compressed-cache rows per sequence (0 for SWA).
    pub(crate) comp_rows: usize,
    pub(crate) rope_positions: usize,
    pub(crate) tiles: AttnTiles,
    /// The hyper-connections' pre, post and comb scales.
    pub(crate) hc_scale: [f32; 3],
}

/// `heads` split into `blocks` contiguous ranges as evenly as possible (none empty).
fn head_ranges(heads: usize, blocks: usize) -> Vec<std::ops::Range<usize>> {
    let b = blocks.clamp(1, heads.max(1));
    (0..b)
        .map(|i| i * heads / b..(i + 1) * heads / b)
        .filter(|r| !r.is_empty())
        .collect()
}

type R<T> = Result<T, RunError>;

fn view<T>(o: &Orchestrator, r: Result<T, TensorError>) -> R<T> {
    r.map_err(|e| o.fatal(format!("dsv4 orchestration: {e}")))
}

/// Rows `a..b`, then (for a 2-D view) columns `c..d`.
fn block(
    o: &Orchestrator,
    t: &Tensor,
    rows: (usize, usize),
    cols: Option<(usize, usize)>,
) -> R<Tensor> {
    let r = view(o, t.slice(0, rows.0 as u64, rows.1 as u64))?;
    match cols {
        Some((a, b)) => view(o, r.slice(1, a as u64, b as u64)),
        None => Ok(r),
    }
}

/// The bound tensors.
pub(crate) struct Views {
    mix: Tensor,
    base: Tensor,
    attn_norm: Tensor,
    wq_a: Tensor,
    q_norm: Tensor,
    wq_b: Tensor,
    wq_b_scale: Tensor,
    wkv: Tensor,
    kv_norm: Tensor,
    wo_a: Tensor,
    wo_b: Tensor,
    wo_b_scale: Tensor,
    sink: Tensor,
    cos: Tensor,
    sin: Tensor,
    window: Tensor,
    hca: Option<HcaViews>,
    csa: Option<orchestrate_csa::CsaViews>,
    tok: Tensor,
    win: Tensor,
    comp: Tensor,
    x: Tensor,
    q: Tensor,
    attn: Tensor,
    y: Tensor,
    x_out: Tensor,
}

struct HcaViews {
    wkv: Tensor,
    wgate: Tensor,
    ape: Tensor,
    norm: Tensor,
    state_kv: Tensor,
    state_score: Tensor,
    cache: Tensor,
}

fn bind_all(o: &mut Orchestrator, a: &RunArgs, p: &AttnPlan) -> R<Views> {
    let c = &p.config;
    let hca = p.kind == LayerKind::Hca;
    let (n_w, n_caches) = match p.kind {
        LayerKind::Swa => (buf::WEIGHTS, 1),
        LayerKind::Hca => (buf::WEIGHTS_HCA, 4),
        LayerKind::Csa => (
            orchestrate_csa::buf::WEIGHTS_CSA,
            1 + orchestrate_csa::buf::CACHES,
        ),
    };
    let want = n_w + n_caches + io::COUNT;
    if a.buffers.len() != want {
        return Err(o.fatal(format!(
            "dsv4 orchestration: {} buffers, expected {want}",
            a.buffers.len()
        )));
    }
    let u = |v: usize| v as u64;
    let (d, hd, h, ql) = (u(c.hidden), u(c.head_dim), u(c.n_heads), u(c.q_lora_rank));
    let (t, m, hcd) = (u(p.tokens), u(c.hc_mix()), u(c.hc_mult * c.hidden));
    let (g, r) = (u(c.o_groups), u(c.o_lora_rank));
    let kg = u(c.heads_per_group() * c.head_dim);
    let pairs = u(c.rope_dim / 2);
    let b = &a.buffers;
    let mut bind = |i: usize, dt: DType, shape: &[u64]| o.bind(&b[i], dt, shape);
    let mut v = Views {
        mix: bind(buf::HC_MIX, DType::F32, &[m, hcd])?,
        base: bind(buf::HC_BASE, DType::F32, &[m])?,
        attn_norm: bind(buf::ATTN_NORM, DType::F32, &[d])?,
        wq_a: bind(buf::WQ_A, DType::BF16, &[ql, d])?,
        q_norm: bind(buf::Q_NORM, DType::F32, &[ql])?,
        wq_b: bind(buf::WQ_B, DType::I8, &[h * hd, ql])?,
        wq_b_scale: bind(buf::WQ_B_SCALE, DType::F32, &[h * hd])?,
        wkv: bind(buf::WKV, DType::BF16, &[hd, d])?,
        kv_norm: bind(buf::KV_NORM, DType::F32, &[hd])?,
        wo_a: bind(buf::WO_A, DType::BF16, &[g * r, kg])?,
        wo_b: bind(buf::WO_B, DType::I8, &[d, g * r])?,
        wo_b_scale: bind(buf::WO_B_SCALE, DType::F32, &[d])?,
        sink: bind(buf::SINK, DType::F32, &[h])?,
        cos: bind(buf::COS, DType::F32, &[u(p.rope_positions), pairs])?,
        sin: bind(buf::SIN, DType::F32, &[u(p.rope_positions), pairs])?,
        window: bind(n_w, DType::BF16, &[u(p.window_slots), hd])?,
        hca: None,
        csa: None,
        tok: bind(n_w + n_caches + io::TOK, DType::U32, &[t, u(ops::TOK_COLS)])?,
        win: bind(n_w + n_caches + io::WIN, DType::I32, &[t, u(c.window)])?,
        comp: bind(
            n_w + n_caches + io::COMP,
            DType::I32,
            &[t, u(p.comp_width.max(1))],
        )?,
        x: bind(n_w + n_caches + io::X, DType::F32, &[t, hcd])?,
        q: bind(n_w + n_caches + io::Q, DType::BF16, &[t, h * hd])?,
        attn: bind(n_w + n_caches + io::ATTN, DType::BF16, &[t, h * hd])?,
        y: bind(n_w + n_caches + io::Y, DType::F32, &[t, d])?,
        x_out: bind(n_w + n_caches + io::X_OUT, DType::F32, &[t, hcd])?,
    };
    if hca {
        let ratio = u(c.hca_ratio);
        let state = [u(p.batch) * ratio, hd];
        v.hca = Some(HcaViews {
            wkv: bind(buf::C_WKV, DType::BF16, &[hd, d])?,
            wgate: bind(buf::C_WGATE, DType::BF16, &[hd, d])?,
            ape: bind(buf::C_APE, DType::F32, &[ratio, hd])?,
            norm: bind(buf::C_NORM, DType::F32, &[hd])?,
            state_kv: bind(n_w + 1, DType::F32, &state)?,
            state_score: bind(n_w + 2, DType::F32, &state)?,
            cache: bind(n_w + 3, DType::BF16, &[u(p.batch * p.comp_rows), hd])?,
        });
    }
    if p.kind == LayerKind::Csa {
        v.csa = Some(orchestrate_csa::bind(
            o,
            a,
            c,
            p.batch,
            p.comp_rows,
            n_w + 1,
        )?);
    }
    Ok(v)
}

/// `out = x_n @ wᵀ` as one SPMD task of the Qwen3 GEMM kernel (phase 1).
fn projection(
    o: &mut Orchestrator,
    xn: &Tensor,
    w: &Tensor,
    out: &Tensor,
    k: usize,
    blocks: u32,
) -> R<()> {
    // SAFETY: `w` is a weight matrix: written by no task during a run.
    let t = unsafe { Task::new(GEMM_TILE).input(xn).no_dep(w) }
        .output_existing(out)
        .push_scalars(GemmScalars {
            k,
            add: false,
            w8a8: false,
        })
        .blocks(blocks)
        .timing_slot(1);
    o.submit(t)?;
    Ok(())
}

/// One SWA or HCA decode step.
pub(crate) fn attn_step(o: &mut Orchestrator, a: &RunArgs, p: &AttnPlan) -> R<()> {
    let v = bind_all(o, a, p)?;
    let c = &p.config;
    let (t_n, hd, h) = (p.tokens, c.head_dim, c.n_heads);
    let (d, ql, hc) = (c.hidden, c.q_lora_rank, c.hc_mult);
    let u = |v: usize| v as u64;
    let blocks = p.tiles.proj_blocks;
    // 0: hc_pre and the attention norm: the mix products split over the mix weight rows
    // (each row read once), then per token the weights, mixed stream and norm.
    let m = hc_mix_len(hc);
    let dots = o.alloc(DType::F32, &[u(t_n), u(m)])?;
    // SAFETY: the hyper-connection weights are written by no task.
    let t = unsafe { Task::new(ops::HC_MIX).input(&v.x).no_dep(&v.mix) }
        .output_existing(&dots)
        .blocks(hc_mix_blocks(p.tiles.vector_blocks, m))
        .timing_slot(0);
    o.submit(t)?;
    let hcw = o.alloc(DType::F32, &[u(t_n), u(m)])?;
    let xn = o.alloc(DType::F32, &[u(t_n), u(packed_ld(d))])?;
    // SAFETY: the hyper-connection biases and the norm weight are written by no task.
    let t = unsafe {
        Task::new(ops::HC_PRE)
            .input(&v.x)
            .input(&dots)
            .no_dep(&v.base)
            .no_dep(&v.attn_norm)
    }
    .output_existing(&hcw)
    .output_existing(&xn)
    .scalar(u(hc))
    .scalar(u(c.hc_sinkhorn_iters))
    .scalar_f32(c.hc_eps)
    .scalar_f32(c.rms_eps);
    let t = t.blocks(u32::try_from(t_n).unwrap_or(u32::MAX));
    let t = push_hc_scales(t, p);
    o.submit(t.timing_slot(0))?;
    // 1: the bf16 projections of x_n.
    let qr = o.alloc(DType::F32, &[u(t_n), u(ql)])?;
    let kv = o.alloc(DType::F32, &[u(t_n), u(hd)])?;
    projection(o, &xn, &v.wq_a, &qr, d, blocks)?;
    projection(
        o,
        &xn,
        &v.wkv,
        &kv,
        d,
        blocks.min(u32::try_from(hd / 16).unwrap_or(1).max(1)),
    )?;
    let comp_in = match &v.hca {
        Some(hv) => {
            let ckv = o.alloc(DType::F32, &[u(t_n), u(hd)])?;
            let cscore = o.alloc(DType::F32, &[u(t_n), u(hd)])?;
            let b2 = blocks.min(u32::try_from(hd / 16).unwrap_or(1).max(1));
            projection(o, &xn, &hv.wkv, &ckv, d, b2)?;
            projection(o, &xn, &hv.wgate, &cscore, d, b2)?;
            Some((ckv, cscore))
        }
        None => None,
    };
    // 2: qr normed and quantised once (the query and indexer projections read it), then the
    // W8A8 query projection, a block of whole heads per SPMD block.
    let (qr_i8, qr_scale) = act_i8(
        o,
        &qr,
        Some(&v.q_norm),
        1,
        c.rms_eps,
        t_n,
        p.tiles.vector_blocks,
        2,
    )?;
    let q = v.q;
    // SAFETY: weights, scales, the host-written token table and the RoPE tables are written by
    // no task during the run.
    let t = unsafe {
        Task::new(ops::Q_B)
            .input(&qr_i8)
            .input(&qr_scale)
            .no_dep(&v.wq_b)
            .no_dep(&v.wq_b_scale)
            .no_dep(&v.tok)
            .no_dep(&v.cos)
            .no_dep(&v.sin)
    }
    .output_existing(&q)
    .scalar(u(hd))
    .scalar_f32(c.rms_eps)
    .blocks(blocks.min(u32::try_from(h).unwrap_or(u32::MAX)))
    .timing_slot(2);
    o.submit(t)?;
    // 3: the window-cache rows, and the compressor.
    // SAFETY: as above (weights and host tables).
    let t = unsafe {
        Task::new(ops::KV_WRITE)
            .input(&kv)
            .no_dep(&v.kv_norm)
            .no_dep(&v.tok)
            .no_dep(&v.cos)
            .no_dep(&v.sin)
    }
    .in_out(&v.window)
    .scalar_f32(c.rms_eps)
    .timing_slot(3);
    o.submit(t)?;
    if let (Some(hv), Some((ckv, cscore))) = (&v.hca, &comp_in) {
        // SAFETY: as above (weights and host tables).
        let t = unsafe {
            Task::new(ops::HCA_COMPRESS)
                .input(ckv)
                .input(cscore)
                .no_dep(&hv.ape)
                .no_dep(&hv.norm)
                .no_dep(&v.tok)
                .no_dep(&v.cos)
                .no_dep(&v.sin)
        }
        .in_out(&hv.state_kv)
        .in_out(&hv.state_score)
        .in_out(&hv.cache)
        .scalar(u(c.hca_ratio))
        .scalar(u(p.comp_rows))
        .scalar_f32(c.rms_eps)
        .timing_slot(3);
        o.submit(t)?;
    }
    if let Some(cv) = &v.csa {
        let io = orchestrate_csa::CsaIo {
            xn: &xn,
            qr_i8: &qr_i8,
            qr_scale: &qr_scale,
            tok: &v.tok,
            cos: &v.cos,
            sin: &v.sin,
            comp: &v.comp,
        };
        orchestrate_csa::submit(o, c, cv, &io, t_n, p.batch, p.comp_rows, blocks, projection)?;
    }
    // 4: attention, one task per (token, block of heads).
    let attn = v.attn;
    let comp = match (&v.hca, &v.csa) {
        (Some(hv), _) => Some((&v.comp, &hv.cache)),
        (None, Some(cv)) => Some((&v.comp, &cv.cache)),
        (None, None) => None,
    };
    attention(o, &v, p, &q, comp, &attn)?;
    // 5, 6: the grouped output projection.
    let (g, r) = (c.o_groups, c.o_lora_rank);
    let o_r = o.alloc(DType::F32, &[u(t_n), u(g * r)])?;
    // SAFETY: `Wo_a` is written by no task.
    let t = unsafe { Task::new(ops::WO_A).input(&attn).no_dep(&v.wo_a) }
        .output_existing(&o_r)
        .scalar(u(g))
        .blocks(blocks)
        .timing_slot(5);
    o.submit(t)?;
    let (or_i8, or_scale) = act_i8(o, &o_r, None, g, c.rms_eps, t_n, p.tiles.vector_blocks, 6)?;
    let y = v.y;
    // SAFETY: `Wo_b` and its scales are written by no task.
    let t = unsafe {
        Task::new(ops::WO_B)
            .input(&or_i8)
            .input(&or_scale)
            .no_dep(&v.wo_b)
            .no_dep(&v.wo_b_scale)
    }
    .output_existing(&y)
    .scalar(u(g))
    .blocks(blocks)
    .timing_slot(6);
    o.submit(t)?;
    // 7: hc_post.
    let t = Task::new(ops::HC_POST)
        .input(&v.x)
        .input(&y)
        .input(&hcw)
        .output_existing(&v.x_out)
        .scalar(u(hc))
        .blocks(u32::try_from(t_n).unwrap_or(u32::MAX))
        .timing_slot(7);
    o.submit(t)?;
    Ok(())
}

/// Submits the per-row int8 quantisation of `x` `[T, K]` (RMS-normed with `norm` first when
/// given) in `groups` spans per row, once for every block of the projection that reads it:
/// returns the int8 rows `[T, K]` and scales `[T, groups]`. `blocks` blocks (the tiling's
/// vector blocks, one per core), at most one per row.
#[allow(clippy::too_many_arguments)]
fn act_i8(
    o: &mut Orchestrator,
    x: &Tensor,
    norm: Option<&Tensor>,
    groups: usize,
    eps: f32,
    tokens: usize,
    blocks: u32,
    slot: u8,
) -> R<(Tensor, Tensor)> {
    let k = x.shape().get(1).copied().unwrap_or(0);
    let q = o.alloc(DType::I8, &[tokens as u64, k])?;
    let s = o.alloc(DType::F32, &[tokens as u64, groups as u64])?;
    let mut t = Task::new(ops::ACT_I8)
        .input(x)
        .output_existing(&q)
        .output_existing(&s);
    if let Some(n) = norm {
        // SAFETY: the norm weight is written by no task.
        t = unsafe { t.no_dep(n) };
    }
    let most = u32::try_from(tokens).unwrap_or(u32::MAX).max(1);
    let t = t
        .scalar(groups as u64)
        .scalar_f32(eps)
        .blocks(blocks.clamp(1, most))
        .timing_slot(slot);
    o.submit(t)?;
    Ok((q, s))
}

/// SPMD blocks of the hc mix products: two per vector block (each block reads every token's
/// residual, so more blocks would re-read it more), at most one per mix row.
fn hc_mix_blocks(vector_blocks: u32, mix_rows: usize) -> u32 {
    (2 * vector_blocks).clamp(1, u32::try_from(mix_rows).unwrap_or(u32::MAX).max(1))
}

/// The hc scales as the kernel's last three scalars.
fn push_hc_scales(t: Task, p: &AttnPlan) -> Task {
    t.scalar_f32(p.hc_scale[0])
        .scalar_f32(p.hc_scale[1])
        .scalar_f32(p.hc_scale[2])
}

/// Phase 4: the sparse attention of every token over its window list and, when given, its
/// compressed list (`(list [T, C], cache [rows, hd])`), one task per (token, head block).
/// The CSA layer passes the list its planning task writes.
pub(crate) fn attention(
    o: &mut Orchestrator,
    v: &Views,
    p: &AttnPlan,
    q: &Tensor,
    comp: Option<(&Tensor, &Tensor)>,
    out: &Tensor,
) -> R<()> {
    let c = &p.config;
    let (hd, h) = (c.head_dim, c.n_heads);
    let heads = head_ranges(h, p.tiles.head_blocks);
    for t in 0..p.tokens {
        let tok = block(o, &v.tok, (t, t + 1), None)?;
        for hr in &heads {
            let cols = Some((hr.start * hd, hr.end * hd));
            let qv = block(o, q, (t, t + 1), cols)?;
            let ov = block(o, out, (t, t + 1), cols)?;
            let win = block(o, &v.win, (t, t + 1), None)?;
            let sinks = block(o, &v.sink, (hr.start, hr.end), None)?;
            // SAFETY: the sinks, the RoPE tables and the host-written token table are written
            // by no task during the run.
            let mut task = unsafe {
                Task::new(ops::SPARSE_ATTN)
                    .input(&qv)
                    .input(&win)
                    .input(&v.window)
                    .no_dep(&sinks)
                    .no_dep(&v.cos)
                    .no_dep(&v.sin)
                    .no_dep(&tok)
            }
            .output_existing(&ov);
            if let Some((list, cache)) = comp {
                let lv = block(o, list, (t, t + 1), None)?;
                task = task.input(&lv).input(cache);
            }
            let task = task
                .scalar(hd as u64)
                .scalar_f32(c.softmax_scale())
                .timing_slot(4);
            o.submit(task)?;
        }
    }
    Ok(())
}
