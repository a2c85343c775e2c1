//! The attention layers' kernels: the W8A8 query projection with its head epilogue, the KV
//! row written into the window cache, the ratio-128 compressor, the sparse attention over a
//! token's candidate lists, and the grouped output projection.

use std::cell::RefCell;

use half::bf16;
use simpler_core::{KernelError, TaskCtx};
use simpler_kernels_cpu as kc;
use simpler_kernels_cpu::dsv4::{self as k, AttnScratch, RopeDir};
use simpler_kernels_cpu::{
    ActsI8, GemmTile, OutMode, PackedActs, WeightsBf16, WeightsI8, packed_len,
};

use super::{bad, check_len, dims2, rope_rows, token};

/// `ACT_I8` argument indices (`NORM` optional, last).
pub(crate) mod act_i8 {
    pub(crate) const X: usize = 0;
    pub(crate) const Q: usize = 1;
    pub(crate) const SCALES: usize = 2;
    pub(crate) const NORM: usize = 3;
}

/// `Q_B` argument indices.
pub(crate) mod q_b {
    pub(crate) const QI8: usize = 0;
    pub(crate) const QS: usize = 1;
    pub(crate) const W: usize = 2;
    pub(crate) const SCALES: usize = 3;
    pub(crate) const TOK: usize = 4;
    pub(crate) const COS: usize = 5;
    pub(crate) const SIN: usize = 6;
    pub(crate) const Q: usize = 7;
}

/// `KV_WRITE` argument indices.
pub(crate) mod kv_write {
    pub(crate) const KV: usize = 0;
    pub(crate) const NORM: usize = 1;
    pub(crate) const TOK: usize = 2;
    pub(crate) const COS: usize = 3;
    pub(crate) const SIN: usize = 4;
    pub(crate) const CACHE: usize = 5;
}

/// `HCA_COMPRESS` argument indices.
pub(crate) mod compress {
    pub(crate) const KV: usize = 0;
    pub(crate) const SCORE: usize = 1;
    pub(crate) const APE: usize = 2;
    pub(crate) const NORM: usize = 3;
    pub(crate) const TOK: usize = 4;
    pub(crate) const COS: usize = 5;
    pub(crate) const SIN: usize = 6;
    pub(crate) const STATE_KV: usize = 7;
    pub(crate) const STATE_SCORE: usize = 8;
    pub(crate) const CACHE: usize = 9;
}

/// `SPARSE_ATTN` argument indices.
pub(crate) mod sparse {
    pub(crate) const Q: usize = 0;
    pub(crate) const WIN: usize = 1;
    pub(crate) const WIN_CACHE: usize = 2;
    pub(crate) const SINKS: usize = 3;
    pub(crate) const COS: usize = 4;
    pub(crate) const SIN: usize = 5;
    /// The token's `tok` row: its position sets the inverse RoPE. A tensor rather than a
    /// scalar, so that one captured step graph serves every position.
    pub(crate) const TOK: usize = 6;
    pub(crate) const OUT: usize = 7;
    pub(crate) const COMP: usize = 8;
    pub(crate) const COMP_CACHE: usize = 9;
}

/// `WO_A` argument indices.
pub(crate) mod wo {
    pub(crate) const X: usize = 0;
    pub(crate) const W: usize = 1;
    pub(crate) const A_OUT: usize = 2;
}

/// `WO_B` argument indices.
pub(crate) mod wo_b {
    pub(crate) const XQ: usize = 0;
    pub(crate) const XS: usize = 1;
    pub(crate) const W: usize = 2;
    pub(crate) const SCALES: usize = 3;
    pub(crate) const OUT: usize = 4;
}

thread_local! {
    /// Per-core buffers of the attention tasks, kept between tasks: the kernel's, and the
    /// fp32 output before its inverse RoPE and rounding into the bf16 `attn` row.
    static ATTN_SCRATCH: RefCell<(AttnScratch, Vec<f32>)> =
        RefCell::new((AttnScratch::default(), Vec::new()));
    /// Per-core buffers of the `wo_a` tasks (packed activations, the block's sums).
    static WO_A_SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The RoPE table's pair count (`[positions, pairs]`).
fn rope_pairs(ctx: &TaskCtx<'_>, i: usize) -> Result<usize, KernelError> {
    Ok(dims2(ctx, i)?.1)
}

/// Per-row int8 activations of a projection input, computed once per step for every SPMD
/// block of the projection that reads them: each token row (optionally RMS-normed with a
/// weight, bf16 values) is quantised in `groups` equal spans, `scale = amax / 127`, ties away
/// from zero (`quantize_row_i8_ties_away`). SPMD over token rows.
pub(super) fn act_i8(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_act_i8";
    let groups = ctx.scalar_usize(0)?;
    let eps = ctx.scalar_f32(1)?;
    let (rows, width) = dims2(ctx, act_i8::X)?;
    if groups == 0 || !width.is_multiple_of(groups) {
        return Err(bad(
            NAME,
            format!("rows of {width} in {groups} equal groups"),
        ));
    }
    let x = ctx.read::<f32>(act_i8::X)?;
    let norm = if ctx.num_args() > act_i8::NORM {
        let n = ctx.read::<f32>(act_i8::NORM)?;
        check_len(NAME, "norm", n.len(), width)?;
        Some(n)
    } else {
        None
    };
    let mut q = ctx.write_block_rows::<i8>(act_i8::Q)?;
    let mut sc = ctx.write_block_rows::<f32>(act_i8::SCALES)?;
    if q.row_len() != width || sc.row_len() != groups || q.len() != sc.len() {
        return Err(bad(
            NAME,
            format!("int8 rows of {width} and {groups} scales per row"),
        ));
    }
    let t0 = q.first_row();
    if t0 + q.len() > rows || sc.first_row() != t0 {
        return Err(bad(NAME, "int8 rows and scales are not the input's rows"));
    }
    let span = width / groups;
    let mut xr = vec![0.0f32; width];
    for r in 0..q.len() {
        xr.copy_from_slice(&x[(t0 + r) * width..(t0 + r + 1) * width]);
        if let Some(n) = norm {
            k::rms_norm_round(&mut xr, width, Some(n), eps);
        }
        let qr = q.row(r);
        let sr = sc.row(r);
        for (g, s) in sr.iter_mut().enumerate() {
            let cols = g * span..(g + 1) * span;
            *s = kc::quantize_row_i8_ties_away(&xr[cols.clone()], &mut qr[cols]);
        }
    }
    Ok(())
}

/// `ActsI8` over `q` (`rows` rows of `cols`) with per-row scales `s`, refused (not a panic)
/// when a value is `-128`, which no quantiser of this layer writes and the int8 paths exclude.
pub(super) fn acts_i8<'a>(
    kernel: &str,
    q: &'a [i8],
    s: &'a [f32],
    rows: usize,
    cols: usize,
) -> Result<ActsI8<'a>, KernelError> {
    check_len(kernel, "int8 activations", q.len(), rows * cols)?;
    check_len(kernel, "activation scales", s.len(), rows)?;
    refuse_i8_min(kernel, q)?;
    Ok(ActsI8::new(q, s, rows, cols, cols))
}

/// Refuses int8 activations holding `-128` (`ActsI8` would panic on them).
fn refuse_i8_min(kernel: &str, q: &[i8]) -> Result<(), KernelError> {
    if q.contains(&i8::MIN) {
        return Err(bad(kernel, "int8 activations hold -128"));
    }
    Ok(())
}

pub(super) fn q_b(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_q_b_w8a8";
    let hd = ctx.scalar_usize(0)?;
    let eps = ctx.scalar_f32(1)?;
    let (rows, ql) = dims2(ctx, q_b::QI8)?;
    let xq = ctx.read::<i8>(q_b::QI8)?;
    let xs = ctx.read::<f32>(q_b::QS)?;
    let (wrows, wcols) = dims2(ctx, q_b::W)?;
    let w = ctx.read::<i8>(q_b::W)?;
    let scales = ctx.read::<f32>(q_b::SCALES)?;
    let tok = ctx.read::<u32>(q_b::TOK)?;
    let (cos, sin) = (ctx.read::<f32>(q_b::COS)?, ctx.read::<f32>(q_b::SIN)?);
    let pairs = rope_pairs(ctx, q_b::COS)?;
    check_len(NAME, "Wq_b scales", scales.len(), wrows)?;
    if wcols != ql || hd == 0 || !wrows.is_multiple_of(hd) || 2 * pairs > hd {
        return Err(bad(
            NAME,
            format!("Wq_b [{wrows}, {wcols}] for q_lora {ql}, heads of {hd}"),
        ));
    }
    let mut q = ctx.write_block_cols::<bf16>(q_b::Q, hd)?;
    if q.len() != rows || q.view_row_len() != wrows {
        return Err(bad(NAME, "q is not [tokens, heads · head_dim]"));
    }
    let (c0, n) = (q.first_col(), q.row_len());
    if n == 0 {
        return Ok(());
    }
    let acts = acts_i8(NAME, xq, xs, rows, ql)?;
    let wi = WeightsI8::with_layout(
        w,
        scales,
        wrows,
        ql,
        crate::dsv4::int8_layout::kernel_layout(crate::dsv4::int8_layout::Int8Use::Attention {
            rows,
        }),
    )
    .rows_range(c0..c0 + n);
    let mut out = vec![0.0f32; rows * n];
    let tile = GemmTile {
        n: 0..n,
        k: 0..ql,
        mode: OutMode::Store,
    };
    kc::gemm_i8_w8a8(wi, acts, &tile, &mut out, n);
    // Every (token, head) norm factor at once: the sums of eight heads run side by side
    // wherever the block has them, not only within one token's heads.
    let heads = n / hd;
    let mut inv = vec![0.0f32; rows * heads];
    k::rms_inv_rows(&out, hd, eps, &mut inv);
    for (t, (o, r)) in out.chunks_exact(n).zip(inv.chunks_exact(heads)).enumerate() {
        let (_, pos, _) = token(NAME, tok, t)?;
        let (c, s) = rope_rows(NAME, cos, sin, pairs, pos)?;
        k::norm_rope_heads_bf16(o, hd, r, c, s, q.row(t));
    }
    Ok(())
}

pub(super) fn kv_write(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_kv_write";
    let eps = ctx.scalar_f32(0)?;
    let (rows, hd) = dims2(ctx, kv_write::KV)?;
    let mut kv = ctx.read::<f32>(kv_write::KV)?.to_vec();
    let norm = ctx.read::<f32>(kv_write::NORM)?;
    let tok = ctx.read::<u32>(kv_write::TOK)?;
    let (cos, sin) = (
        ctx.read::<f32>(kv_write::COS)?,
        ctx.read::<f32>(kv_write::SIN)?,
    );
    let pairs = rope_pairs(ctx, kv_write::COS)?;
    check_len(NAME, "kv_norm", norm.len(), hd)?;
    let (slots, width) = dims2(ctx, kv_write::CACHE)?;
    if width != hd || 2 * pairs > hd {
        return Err(bad(
            NAME,
            format!("cache rows of {width} for kv rows of {hd}"),
        ));
    }
    let cache = ctx.write::<bf16>(kv_write::CACHE)?;
    k::rms_norm_round(&mut kv, hd, Some(norm), eps);
    for (t, row) in kv.chunks_exact_mut(hd).enumerate().take(rows) {
        let (_, pos, slot) = token(NAME, tok, t)?;
        let (c, s) = rope_rows(NAME, cos, sin, pairs, pos)?;
        k::rope_interleaved(row, hd, c, s, RopeDir::Forward);
        let Some(slot) = slot else { continue };
        if slot >= slots {
            return Err(bad(
                NAME,
                format!("slot {slot} outside the cache's {slots}"),
            ));
        }
        kc::cast_f32_bf16(row, &mut cache[slot * hd..(slot + 1) * hd]);
    }
    Ok(())
}

pub(super) fn hca_compress(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_hca_compress";
    let ratio = ctx.scalar_usize(0)?;
    let max_rows = ctx.scalar_usize(1)?;
    let eps = ctx.scalar_f32(2)?;
    let (rows, w) = dims2(ctx, compress::KV)?;
    let kv = ctx.read::<f32>(compress::KV)?;
    let score = ctx.read::<f32>(compress::SCORE)?;
    let ape = ctx.read::<f32>(compress::APE)?;
    let norm = ctx.read::<f32>(compress::NORM)?;
    let tok = ctx.read::<u32>(compress::TOK)?;
    let (cos, sin) = (
        ctx.read::<f32>(compress::COS)?,
        ctx.read::<f32>(compress::SIN)?,
    );
    let pairs = rope_pairs(ctx, compress::COS)?;
    check_len(NAME, "score", score.len(), rows * w)?;
    check_len(NAME, "ape", ape.len(), ratio * w)?;
    check_len(NAME, "norm", norm.len(), w)?;
    let (state_rows, _) = dims2(ctx, compress::STATE_KV)?;
    let (cache_rows, _) = dims2(ctx, compress::CACHE)?;
    if ratio == 0 || 2 * pairs > w {
        return Err(bad(
            NAME,
            format!("ratio {ratio}, rows of {w}, {pairs} RoPE pairs"),
        ));
    }
    let state_kv = ctx.write::<f32>(compress::STATE_KV)?;
    let state_score = ctx.write::<f32>(compress::STATE_SCORE)?;
    let cache = ctx.write::<bf16>(compress::CACHE)?;
    check_len(NAME, "state score", state_score.len(), state_kv.len())?;
    check_len(NAME, "state", state_kv.len(), state_rows * w)?;
    check_len(NAME, "compressed cache", cache.len(), cache_rows * w)?;
    let mut pooled = vec![0.0f32; w];
    for t in 0..rows {
        let (seq, pos, write) = token(NAME, tok, t)?;
        if write.is_none() {
            continue;
        }
        let slot = seq * ratio + pos % ratio;
        if (seq + 1) * ratio > state_rows {
            return Err(bad(
                NAME,
                format!("sequence {seq} outside the state's {state_rows} rows"),
            ));
        }
        state_kv[slot * w..(slot + 1) * w].copy_from_slice(&kv[t * w..(t + 1) * w]);
        let a = &ape[(pos % ratio) * w..(pos % ratio + 1) * w];
        for ((o, &s), &a) in state_score[slot * w..(slot + 1) * w]
            .iter_mut()
            .zip(&score[t * w..(t + 1) * w])
            .zip(a)
        {
            *o = s + a;
        }
        if (pos + 1) % ratio != 0 {
            continue;
        }
        let win = seq * ratio..(seq + 1) * ratio;
        let kr: Vec<&[f32]> = win.clone().map(|r| &state_kv[r * w..(r + 1) * w]).collect();
        let sr: Vec<&[f32]> = win.map(|r| &state_score[r * w..(r + 1) * w]).collect();
        k::softmax_pool(&kr, &sr, &mut pooled);
        k::rms_norm_round(&mut pooled, w, Some(norm), eps);
        let (c, s) = rope_rows(NAME, cos, sin, pairs, pos + 1 - ratio)?;
        k::rope_interleaved(&mut pooled, w, c, s, RopeDir::Forward);
        let row = seq * max_rows + (pos + 1) / ratio - 1;
        if (pos + 1) / ratio > max_rows || row >= cache_rows {
            return Err(bad(NAME, format!("compressed row {row} outside the cache")));
        }
        kc::cast_f32_bf16(&pooled, &mut cache[row * w..(row + 1) * w]);
    }
    Ok(())
}

/// The rows of a candidate list (`-1`: masked) in a cache of `rows` rows of `width`, rows
/// that follow each other in the list and in the cache as one run (the kernel reads long runs
/// in place instead of copying them).
fn candidates<'a>(
    list: &[i32],
    cache: &'a [bf16],
    width: usize,
    out: &mut Vec<Option<&'a [bf16]>>,
) -> Result<(), KernelError> {
    let rows = cache.len() / width.max(1);
    // The first row and length of the run last pushed by this call.
    let mut run: Option<(usize, usize)> = None;
    for &c in list {
        match usize::try_from(c) {
            Ok(r) if r < rows => match (run, out.last_mut()) {
                (Some((r0, k)), Some(last)) if r == r0 + k => {
                    *last = Some(&cache[r0 * width..(r + 1) * width]);
                    run = Some((r0, k + 1));
                }
                _ => {
                    out.push(Some(&cache[r * width..(r + 1) * width]));
                    run = Some((r, 1));
                }
            },
            Ok(r) => {
                return Err(bad(
                    "dsv4_sparse_attention",
                    format!("candidate row {r} outside a cache of {rows}"),
                ));
            }
            Err(_) => {
                out.push(None);
                run = None;
            }
        }
    }
    Ok(())
}

pub(super) fn sparse_attn(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_sparse_attention";
    let hd = ctx.scalar_usize(0)?;
    let scale = ctx.scalar_f32(1)?;
    let (_, pos, _) = token(NAME, ctx.read::<u32>(sparse::TOK)?, 0)?;
    let q = ctx.read::<bf16>(sparse::Q)?;
    let win = ctx.read::<i32>(sparse::WIN)?;
    let wcache = ctx.read::<bf16>(sparse::WIN_CACHE)?;
    let sinks = ctx.read::<f32>(sparse::SINKS)?;
    let (cos, sin) = (ctx.read::<f32>(sparse::COS)?, ctx.read::<f32>(sparse::SIN)?);
    let pairs = rope_pairs(ctx, sparse::COS)?;
    let heads = sinks.len();
    check_len(NAME, "q", q.len(), heads * hd)?;
    if hd == 0 || dims2(ctx, sparse::WIN_CACHE)?.1 != hd || 2 * pairs > hd {
        return Err(bad(NAME, format!("window-cache rows are not {hd} wide")));
    }
    let mut cands = Vec::with_capacity(win.len() + 64);
    candidates(win, wcache, hd, &mut cands)?;
    if ctx.num_args() > sparse::COMP_CACHE {
        let comp = ctx.read::<i32>(sparse::COMP)?;
        let ccache = ctx.read::<bf16>(sparse::COMP_CACHE)?;
        if dims2(ctx, sparse::COMP_CACHE)?.1 != hd {
            return Err(bad(
                NAME,
                format!("compressed-cache rows are not {hd} wide"),
            ));
        }
        candidates(comp, ccache, hd, &mut cands)?;
    }
    let out = ctx.write::<bf16>(sparse::OUT)?;
    check_len(NAME, "out", out.len(), heads * hd)?;
    let (c, s) = rope_rows(NAME, cos, sin, pairs, pos)?;
    // The fp32 result stays in a per-core buffer (in cache from the second task on); `attn`
    // takes its bf16 rounding, half the bytes of fp32 slots to write here and for `wo_a` to
    // read.
    ATTN_SCRATCH.with_borrow_mut(|(scratch, o)| {
        o.resize(heads * hd, 0.0);
        k::sparse_attention(k::Queries::Bf16(q), hd, &cands, scale, sinks, o, scratch);
        k::rope_interleaved(o, hd, c, s, RopeDir::Inverse);
        kc::cast_f32_bf16(o, out);
    });
    Ok(())
}

pub(super) fn wo_a(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_wo_a";
    let groups = ctx.scalar_usize(0)?;
    let (rows, width) = dims2(ctx, wo::X)?;
    let x = ctx.read::<bf16>(wo::X)?;
    let (wrows, kg) = dims2(ctx, wo::W)?;
    let w = ctx.read::<bf16>(wo::W)?;
    if groups == 0 || !wrows.is_multiple_of(groups) || kg * groups != width {
        return Err(bad(
            NAME,
            format!("Wo_a [{wrows}, {kg}] in {groups} groups for rows of {width}"),
        ));
    }
    let r = wrows / groups;
    // Paired, tiled or row-major as the upload held it (`dsv4::bf16_layout`): every output
    // group and block then starts on a row group.
    let layout = crate::dsv4::bf16_layout::wo_a_kernel_layout(groups, r, kg);
    let whole = WeightsBf16::with_layout(w, wrows, kg, layout);
    let mut out = ctx.write_block_cols::<f32>(wo::A_OUT, kc::PACK_BLOCK)?;
    if out.len() != rows || out.view_row_len() != wrows {
        return Err(bad(NAME, "o_r is not [tokens, groups · o_lora]"));
    }
    let (c0, n) = (out.first_col(), out.row_len());
    // The packed group rows and the block's sums live in per-core buffers kept between tasks:
    // at FLASH shapes each is ~128 KiB, past the allocator's mmap threshold, so fresh vectors
    // cost a mapping and its page faults on every block. Each block packs its groups afresh:
    // the AMX product then converts them while it prefetches the block's first weight rows,
    // which streamed faster than tiles made once per core and task and reused (3% fewer
    // cycles, `docs/benchmarks.md`, session 34).
    WO_A_SCRATCH.with_borrow_mut(|(packed, res)| {
        let ld = kc::packed_ld(kg);
        packed.resize(packed_len(rows, kg), 0.0);
        res.resize(rows * n, 0.0);
        let mut c = c0;
        while c < c0 + n {
            let g = c / r;
            let end = ((g + 1) * r).min(c0 + n);
            for t in 0..rows {
                let src = &x[t * width + g * kg..t * width + (g + 1) * kg];
                kc::pack_acts_bf16(src, 1, kg, &mut packed[t * ld..(t + 1) * ld]);
            }
            let wg = whole.row_range(c..end);
            let tile = GemmTile::full(&wg);
            kc::gemm_bf16(
                wg,
                PackedActs::new(&packed[..], rows, kg),
                &tile,
                &mut res[c - c0..],
                n,
            );
            c = end;
        }
        for t in 0..rows {
            out.row(t).copy_from_slice(&res[t * n..(t + 1) * n]);
        }
    });
    Ok(())
}

pub(super) fn wo_b(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "dsv4_wo_b_w8a8";
    let groups = ctx.scalar_usize(0)?;
    let (rows, width) = dims2(ctx, wo_b::XQ)?;
    let xq = ctx.read::<i8>(wo_b::XQ)?;
    let xs = ctx.read::<f32>(wo_b::XS)?;
    let (wrows, wcols) = dims2(ctx, wo_b::W)?;
    let w = ctx.read::<i8>(wo_b::W)?;
    let scales = ctx.read::<f32>(wo_b::SCALES)?;
    check_len(NAME, "Wo_b scales", scales.len(), wrows)?;
    check_len(NAME, "o_r scales", xs.len(), rows * groups)?;
    if groups == 0 || wcols != width || !width.is_multiple_of(groups) {
        return Err(bad(
            NAME,
            format!("Wo_b [{wrows}, {wcols}] in {groups} groups for rows of {width}"),
        ));
    }
    let mut out = ctx.write_block_cols::<f32>(wo_b::OUT, kc::PACK_BLOCK)?;
    if out.len() != rows || out.view_row_len() != wrows {
        return Err(bad(NAME, "y is not [tokens, hidden]"));
    }
    let (c0, n) = (out.first_col(), out.row_len());
    if n == 0 {
        return Ok(());
    }
    // `xs` is `[tokens, groups]`, one scale per (token, group): one grouped product streams
    // each weight row once, where a product per group would walk every row `groups` times
    // in strided pieces.
    check_len(NAME, "o_r int8", xq.len(), rows * width)?;
    refuse_i8_min(NAME, xq)?;
    let wi = WeightsI8::with_layout(
        w,
        scales,
        wrows,
        width,
        crate::dsv4::int8_layout::kernel_layout(crate::dsv4::int8_layout::Int8Use::Attention {
            rows,
        }),
    )
    .rows_range(c0..c0 + n);
    let mut res = vec![0.0f32; rows * n];
    let acts = ActsI8::grouped(xq, xs, rows, width, width, groups);
    let tile = GemmTile {
        n: 0..n,
        k: 0..width,
        mode: OutMode::Add,
    };
    kc::gemm_i8_w8a8(wi, acts, &tile, &mut res, n);
    k::round_bf16(&mut res);
    for t in 0..rows {
        out.row(t).copy_from_slice(&res[t * n..(t + 1) * n]);
    }
    Ok(())
}
