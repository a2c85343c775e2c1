//! Attention kernels: split-KV decode attention with its combine, and chunked causal prefill
//! attention. (The q/k norm + RoPE and the K/V writes are the q/k/v projections' epilogue,
//! `dense::gemm_rope_step`.)

use std::ops::Range;

use half::bf16;
use simpler_core::{KernelError, TaskCtx};
use simpler_kernels_cpu as k;
use simpler_kernels_cpu::{PagedKv, partial_len};

use super::args::{attn_combine, attn_decode, attn_prefill};
use super::scalars::{AttnCombineScalars, AttnDecodeScalars, AttnPrefillScalars, KernelScalars};
use super::{bad, check_packed_range, dims2, store_packed, with_scratch};
use crate::qwen3::plan::KvSplit;

/// Entries of a decode row's step record: `[seq_len, slot]`.
pub(crate) const STEP_FIELDS: usize = 2;

// Decode and prefill attention place the pools and the table alike, so `paged` serves both.
const _: () = assert!(
    attn_decode::k_pool == attn_prefill::k_pool
        && attn_decode::v_pool == attn_prefill::v_pool
        && attn_decode::table == attn_prefill::table
);

/// The K/V pools and the block-table row of a decode or prefill attention task, checked to
/// cover tokens `0..tokens`.
fn paged<'a>(
    ctx: &'a TaskCtx<'_>,
    head_dim: usize,
    page_size: usize,
    tokens: usize,
    name: &str,
) -> Result<(PagedKv<'a>, &'a [u32]), KernelError> {
    let (slots, row) = dims2(ctx, attn_decode::k_pool)?;
    let kp = ctx.read::<bf16>(attn_decode::k_pool)?;
    let vp = ctx.read::<bf16>(attn_decode::v_pool)?;
    let table = ctx.read::<u32>(attn_decode::table)?;
    if head_dim == 0 || page_size == 0 || !row.is_multiple_of(head_dim) || kp.len() != vp.len() {
        return Err(bad(
            name,
            format!("pools of rows {row} for head_dim {head_dim}, page {page_size}"),
        ));
    }
    simpler_kernels_cpu::paging::check_table(table, page_size, 0..tokens, slots)
        .map_err(|e| bad(name, e))?;
    let kv = PagedKv {
        k: kp,
        v: vp,
        kv_heads: row / head_dim,
        head_dim,
        page_size,
    };
    Ok((kv, table))
}

/// Checks that each head of `heads` (`per_head` columns each) is a valid packed column range
/// of a row of `nq` columns, as `store_packed` needs.
fn check_heads_packed(
    name: &str,
    heads: Range<usize>,
    per_head: usize,
    nq: usize,
) -> Result<(), KernelError> {
    for g in heads {
        check_packed_range(name, g * per_head, per_head, nq)?;
    }
    Ok(())
}

/// Merges `chunks` partial sets (each `[kv_heads, plen]`) into `out`, the packed row of the
/// attention output (`kv_heads * group * d` columns).
fn combine_into(
    parts: &[f32],
    chunks: usize,
    kv_heads: usize,
    group: usize,
    d: usize,
    out: &mut [f32],
) {
    combine_heads(parts, chunks, kv_heads, 0..kv_heads, group, d, out);
}

/// [`combine_into`] of KV heads `heads` only: `out` holds their columns of the packed row
/// (`heads.len() * group * d`, from column `heads.start * group * d`).
fn combine_heads(
    parts: &[f32],
    chunks: usize,
    kv_heads: usize,
    heads: Range<usize>,
    group: usize,
    d: usize,
    out: &mut [f32],
) {
    let plen = partial_len(group, d);
    let per_head = group * d;
    let nq = kv_heads * per_head;
    let first = heads.start * per_head;
    let mut mine = vec![0.0f32; chunks * plen];
    let mut o = vec![bf16::ZERO; per_head];
    for g in heads {
        for c in 0..chunks {
            let at = (c * kv_heads + g) * plen;
            mine[c * plen..(c + 1) * plen].copy_from_slice(&parts[at..at + plen]);
        }
        k::decode_attention_combine_bf16(&mine, group, d, &mut o);
        let c0 = g * per_head;
        store_packed(&mut out[c0 - first..c0 - first + per_head], c0, nq, |i| {
            o[i].to_f32()
        });
    }
}

pub(super) fn decode(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "attention_decode_bf16";
    let AttnDecodeScalars {
        chunk,
        chunks,
        short,
        scale,
        page,
        head_dim: d,
    } = AttnDecodeScalars::read(ctx)?;
    let step = ctx.read::<u32>(attn_decode::step)?;
    // An SPMD task has a block per chunk (`chunk` 0; each block's partial is its row of the
    // output); a single-block task computes chunk `chunk`.
    let blocks = ctx.block_num();
    let spmd_ok = blocks == 1 || (blocks == chunks && chunk == 0);
    let chunk = chunk + ctx.block_idx();
    if step.len() != STEP_FIELDS || chunk >= chunks || short > chunks || !spmd_ok {
        return Err(bad(
            NAME,
            format!(
                "chunk {chunk} of {chunks} ({short} short, {blocks} blocks) with {} step entries",
                step.len()
            ),
        ));
    }
    let is_final = chunks == 1;
    let Range { start: t0, end: t1 } = KvSplit { chunks, short }.range(step[0] as usize, chunk);
    let q = ctx.read::<bf16>(attn_decode::q)?;
    let (kv, table) = paged(ctx, d, page, t1, NAME)?;
    let nq = q.len();
    if kv.row() == 0 || !nq.is_multiple_of(kv.row()) || nq == 0 || t0 > t1 {
        return Err(bad(
            NAME,
            format!("query of {nq} for {} KV heads of {d}", kv.kv_heads),
        ));
    }
    let group = nq / kv.row();
    let all = kv.kv_heads * partial_len(group, d);
    if !is_final {
        let mut slot = ctx.write_block_rows::<f32>(attn_decode::out)?;
        let want_row = if blocks > 1 { ctx.block_idx() } else { 0 };
        if slot.len() != 1 || slot.row_len() != all || slot.first_row() != want_row {
            return Err(bad(
                NAME,
                format!(
                    "partial rows {}..{} of {} floats for block {} of {blocks}, expected row {want_row} of {all}",
                    slot.first_row(),
                    slot.first_row() + slot.len(),
                    slot.row_len(),
                    ctx.block_idx()
                ),
            ));
        }
        k::decode_attention_heads_bf16(q, group, &kv, table, t0..t1, scale, slot.row(0));
        return Ok(());
    }
    let out = ctx.write::<f32>(attn_decode::out)?;
    if out.len() != nq {
        return Err(bad(
            NAME,
            format!("output of {} floats for a row of {nq}", out.len()),
        ));
    }
    check_packed_range(NAME, 0, nq, nq)?;
    check_heads_packed(NAME, 0..kv.kv_heads, group * d, nq)?;
    with_scratch(all, |p| {
        k::decode_attention_heads_bf16(q, group, &kv, table, t0..t1, scale, p);
        combine_into(p, 1, kv.kv_heads, group, d, out);
    });
    Ok(())
}

pub(super) fn combine(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "attention_combine_f32";
    let AttnCombineScalars {
        kv_heads,
        group,
        head_dim: d,
    } = AttnCombineScalars::read(ctx)?;
    let partials = ctx.read::<f32>(attn_combine::partials)?;
    let set = kv_heads * partial_len(group, d);
    if set == 0 || !partials.len().is_multiple_of(set) {
        return Err(bad(
            NAME,
            format!("{} floats are not partial sets of {set}", partials.len()),
        ));
    }
    // An SPMD combine (the sequence whose attention ends the phase) takes a share of the KV
    // heads per block; a head's columns of the packed row are its own (`group · d` is whole
    // 16-column blocks, checked below).
    let per_head = group * d;
    let nq = kv_heads * per_head;
    let mut out = ctx.write_block_cols::<f32>(attn_combine::out, per_head)?;
    if out.len() != 1 || out.view_row_len() != nq {
        return Err(bad(
            NAME,
            format!(
                "output of {} rows of {} floats for a row of {nq}",
                out.len(),
                out.view_row_len()
            ),
        ));
    }
    if ctx.block_num() > 1 {
        check_packed_range(NAME, 0, per_head, nq)?;
    }
    let heads = out.first_col() / per_head..(out.first_col() + out.row_len()) / per_head;
    check_heads_packed(NAME, heads.clone(), per_head, nq)?;
    combine_heads(
        partials,
        partials.len() / set,
        kv_heads,
        heads,
        group,
        d,
        out.row(0),
    );
    Ok(())
}

pub(super) fn prefill(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "attention_prefill_bf16";
    let AttnPrefillScalars {
        kv_head,
        first_pos,
        scale,
        page,
        c0,
        q_width: nq,
        head_dim: d,
    } = AttnPrefillScalars::read(ctx)?;
    let (n, qcols) = dims2(ctx, attn_prefill::q)?;
    let q = ctx.read::<bf16>(attn_prefill::q)?;
    let (kv, table) = paged(ctx, d, page, first_pos + n, NAME)?;
    if qcols != nq || kv_head >= kv.kv_heads || !nq.is_multiple_of(kv.row()) {
        return Err(bad(
            NAME,
            format!(
                "query rows of {qcols} for {} KV heads, head {kv_head}",
                kv.kv_heads
            ),
        ));
    }
    let group = nq / kv.row();
    let per_row = group * d;
    check_packed_range(NAME, c0, per_row, nq)?;
    if !d.is_multiple_of(k::PACK_BLOCK) {
        // The kernel packs each head as whole packing blocks (the upload refuses such models).
        return Err(bad(
            NAME,
            format!(
                "head_dim {d} is not whole packing blocks of {}",
                k::PACK_BLOCK
            ),
        ));
    }
    let mut out = ctx.write_rows::<f32>(attn_prefill::out)?;
    if out.len() != n || out.row_len() != per_row {
        return Err(bad(
            NAME,
            format!(
                "output [{}, {}] for {n} rows of {per_row}",
                out.len(),
                out.row_len()
            ),
        ));
    }
    // The queries are read where they lie in the Q rows, and the outputs leave the kernel
    // rounded to bf16 and packed into the rows (widening the queries into a copy, then rounding
    // and packing an fp32 copy of the outputs, was ~10% of these tasks' time at 512 tokens).
    let rows = k::PrefillRows {
        queries: k::PrefillQueries::Bf16 {
            rows: q,
            stride: nq,
            offset: kv_head * per_row,
            n_rows: n,
        },
        group,
        kv,
        block_table: table,
        kv_head,
        first_pos,
        scale,
    };
    let mut outs: Vec<&mut [f32]> = out.iter_mut().collect();
    k::prefill_attention_rows_packed(&rows, &mut outs);
    Ok(())
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use simpler_core::{DType, RunArgs, ScopeKind, Task, Worker};
    use simpler_kernels_cpu::partial_len;

    use super::super::args::{Arg, AttnDecodeArgs};
    use super::super::scalars::{AttnDecodeScalars, PushScalars};

    /// One KV head of 32, group 2, page 16: a sequence of 100 tokens over 7 pages.
    const D: usize = 32;
    const GROUP: usize = 2;
    const PAGE: usize = 16;
    const LEN: usize = 100;
    const CHUNKS: usize = 3;

    /// Runs one decode-attention task of `blocks` blocks with first chunk `chunk` over the
    /// sequence, writing `out_rows` partial rows; returns the partials or the run's error.
    fn run(w: &Worker, blocks: u32, chunk: usize, out_rows: usize) -> Result<Vec<f32>, String> {
        let pages = LEN.div_ceil(PAGE);
        let val = |i: usize, s: usize| bf16::from_f32(((i * s) % 97) as f32 / 97.0 - 0.5);
        let q: Vec<bf16> = (0..GROUP * D).map(|i| val(i, 13)).collect();
        let k: Vec<bf16> = (0..pages * PAGE * D).map(|i| val(i, 31)).collect();
        let v: Vec<bf16> = (0..pages * PAGE * D).map(|i| val(i, 7)).collect();
        // Pages in reverse order, so the table matters.
        let table: Vec<u32> = (0..pages as u32).rev().collect();
        let step = [LEN as u32, 0];
        let set = partial_len(GROUP, D);
        let bufs = vec![
            w.buffer_from(&q).unwrap(),
            w.buffer_from(&k).unwrap(),
            w.buffer_from(&v).unwrap(),
            w.buffer_from(&table).unwrap(),
            w.buffer_from(&step).unwrap(),
            w.alloc(out_rows * set * 4).unwrap(),
        ];
        let out = bufs[5].clone();
        let args = RunArgs {
            buffers: bufs,
            scalars: vec![],
        };
        w.run_fn("attention", args, &Default::default(), move |o, a| {
            let u = |v: usize| v as u64;
            let q = o.bind(&a.buffers[0], DType::BF16, &[1, u(GROUP * D)])?;
            let kp = o.bind(&a.buffers[1], DType::BF16, &[u(pages * PAGE), u(D)])?;
            let vp = o.bind(&a.buffers[2], DType::BF16, &[u(pages * PAGE), u(D)])?;
            let table = o.bind(&a.buffers[3], DType::U32, &[1, u(pages)])?;
            let step = o.bind(&a.buffers[4], DType::U32, &[1, 2])?;
            let out = o.bind(&a.buffers[5], DType::F32, &[u(out_rows), u(set)])?;
            o.scope(ScopeKind::Auto, |o| {
                let task = AttnDecodeArgs {
                    q: Arg::In(&q),
                    k_pool: Arg::In(&kp),
                    v_pool: Arg::In(&vp),
                    table: Arg::In(&table),
                    step: Arg::In(&step),
                    out: Arg::Out(&out),
                }
                .push(Task::new(super::super::ATTN_DECODE))
                .blocks(blocks)
                .push_scalars(AttnDecodeScalars {
                    chunk,
                    chunks: CHUNKS,
                    short: 1,
                    scale: 0.125,
                    page: PAGE,
                    head_dim: D,
                });
                o.submit(task)?;
                Ok(())
            })
        })
        .map_err(|e| e.to_string())?;
        Ok(out.read::<f32>().unwrap())
    }

    /// A task of one block per chunk writes, row by row, the partials that one single-block
    /// task per chunk writes, bit for bit; a task whose blocks are not one per chunk from
    /// chunk 0 is refused by name, and the worker's next run is unaffected.
    #[test]
    fn a_block_per_chunk_equals_a_task_per_chunk_and_other_splits_are_refused() {
        let w = super::super::test_worker();
        let spmd = run(&w, CHUNKS as u32, 0, CHUNKS).unwrap();
        let set = partial_len(GROUP, D);
        for c in 0..CHUNKS {
            let alone = run(&w, 1, c, 1).unwrap();
            assert_eq!(
                spmd[c * set..(c + 1) * set]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "chunk {c}"
            );
        }
        for (blocks, chunk) in [(2, 0), (CHUNKS as u32, 1)] {
            let err = run(&w, blocks, chunk, CHUNKS).unwrap_err();
            assert!(
                err.contains("attention_decode_bf16") && err.contains(&format!("{blocks} blocks")),
                "{blocks} blocks from chunk {chunk}: {err}"
            );
        }
        assert_eq!(run(&w, CHUNKS as u32, 0, CHUNKS).unwrap(), spmd);
    }

    /// A one-block combine of 2 KV heads of head_dim 8 (group 1): the second head's columns
    /// start inside a 16-column packing block, which the packed store cannot write. The task
    /// is refused naming the columns (it indexed past its block and panicked), its output is
    /// left unwritten, and the worker's next run of a valid combine goes on as before.
    #[test]
    fn a_combine_whose_heads_split_packing_blocks_is_refused() {
        use super::super::args::AttnCombineArgs;
        use super::super::scalars::AttnCombineScalars;
        let w = super::super::test_worker();
        let run = |kv_heads: usize, d: usize| {
            let set = kv_heads * partial_len(1, d);
            let width = kv_heads * d;
            // Each head's partial: max 0, sum 1, outputs 1.0 (so the combined outputs are 1).
            let mut partials = vec![0.0f32; set];
            for h in partials.chunks_exact_mut(partial_len(1, d)) {
                h[1] = 1.0;
                h[2..].fill(1.0);
            }
            let bufs = vec![
                w.buffer_from(&partials).unwrap(),
                w.buffer_from(&vec![-7.0f32; width]).unwrap(),
            ];
            let out = bufs[1].clone();
            let r = w.run_fn(
                "combine",
                RunArgs {
                    buffers: bufs,
                    scalars: vec![],
                },
                &Default::default(),
                move |o, a| {
                    let p = o.bind(&a.buffers[0], DType::F32, &[1, set as u64])?;
                    let out = o.bind(&a.buffers[1], DType::F32, &[1, width as u64])?;
                    let t = AttnCombineArgs {
                        partials: Arg::In(&p),
                        out: Arg::Out(&out),
                    }
                    .push(Task::new(super::super::ATTN_COMBINE))
                    .push_scalars(AttnCombineScalars {
                        kv_heads,
                        group: 1,
                        head_dim: d,
                    });
                    o.submit(t)?;
                    Ok(())
                },
            );
            (r, out.read::<f32>().unwrap())
        };
        let (r, out) = run(2, 8);
        let e = r
            .expect_err("a combine of heads splitting packing blocks ran")
            .to_string();
        assert!(
            e.contains("attention_combine_f32: packed columns 0..8 of 16")
                && !e.contains("panicked"),
            "{e}"
        );
        assert!(
            out.iter().all(|&x| x == -7.0),
            "the refused task wrote {out:?}"
        );
        let (r, out) = run(2, 16);
        r.unwrap();
        assert!(out.iter().all(|&x| x != -7.0), "{out:?}");
    }
}
