//! Vector kernels of the step: embedding gather, casts, copies and the two RMSNorm forms that
//! write packed GEMM activations.

use half::bf16;
use simpler_core::{KernelError, TaskCtx};
use simpler_kernels_cpu as k;

use super::args::{cast, embed, norm, norm_deferred};
use super::scalars::{KernelScalars, NormScalars};
use super::{bad, check_packed, dims2};
use crate::qwen3::layout::bf16_layout;

pub(super) fn embed(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    let (vocab, hidden) = dims2(ctx, embed::table)?;
    let table = ctx.read::<bf16>(embed::table)?;
    let ids = ctx.read::<u32>(embed::ids)?;
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(bad(
            "embedding_gather_bf16",
            format!("token id {id} outside the vocabulary of {vocab}"),
        ));
    }
    let x = ctx.write::<f32>(embed::x)?;
    if x.len() != ids.len() * hidden {
        return Err(bad(
            "embedding_gather_bf16",
            format!(
                "output holds {} floats for {} ids of {hidden}",
                x.len(),
                ids.len()
            ),
        ));
    }
    // The table's layout follows from its shape (`qwen3::layout`; a tied LM head is this
    // buffer).
    let t = k::WeightsBf16::with_layout(table, vocab, hidden, bf16_layout(vocab, hidden));
    k::embedding_gather_rows_bf16(t, ids, x);
    Ok(())
}

/// `dst = f(src)` element by element ([`cast`]'s arguments, equal lengths).
fn map_elements<S: simpler_core::Element, D: simpler_core::Element>(
    ctx: &TaskCtx<'_>,
    name: &str,
    f: impl FnOnce(&[S], &mut [D]),
) -> Result<(), KernelError> {
    let src = ctx.read::<S>(cast::src)?;
    let dst = ctx.write::<D>(cast::dst)?;
    if src.len() != dst.len() {
        return Err(bad(name, "source and destination lengths differ"));
    }
    f(src, dst);
    Ok(())
}

pub(super) fn cast_bf16_f32(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    map_elements(ctx, "cast_bf16_f32", k::cast_bf16_f32)
}

pub(super) fn cast_f32_bf16(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    map_elements(ctx, "cast_f32_bf16", k::cast_f32_bf16)
}

pub(super) fn copy_f32(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    map_elements(ctx, "copy_f32", |s: &[f32], d: &mut [f32]| {
        d.copy_from_slice(s)
    })
}

// Both norms read their first three tensors alike.
const _: () = assert!(
    norm_deferred::x == norm::x
        && norm_deferred::g == norm::g
        && norm_deferred::packed == norm::packed
);

/// Each block normalises its share of the rows, `ceil(rows / blocks)` (the orchestration gives
/// decode's norms a block per core: as one block it ran on one core while the other waited for
/// the projections it feeds); its packed rows and scales are chunks of the contiguous outputs.
pub(super) fn rms_norm_deferred(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "rms_norm_deferred_f32";
    let (rows, h) = dims2(ctx, norm::x)?;
    let x = ctx.read::<f32>(norm::x)?;
    let g = ctx.read::<f32>(norm::g)?;
    let NormScalars { eps } = NormScalars::read(ctx)?;
    if g.len() != h {
        return Err(bad(
            NAME,
            format!("norm weight of {} for rows of {h}", g.len()),
        ));
    }
    let ld = k::packed_ld(h);
    let (packed_len, scales) = (
        ctx.tensor(norm::packed)?.numel() as usize,
        ctx.tensor(norm_deferred::r)?.numel() as usize,
    );
    check_packed(NAME, packed_len, rows, h)?;
    if scales != rows {
        return Err(bad(NAME, format!("{scales} scales for {rows} rows")));
    }
    let per = rows.div_ceil(ctx.block_num().max(1));
    let first = (ctx.block_idx() * per).min(rows);
    let packed = ctx.write_chunk::<f32>(norm::packed, per * ld)?;
    let r = ctx.write_chunk::<f32>(norm_deferred::r, per)?;
    let n = r.len();
    if packed.len() != n * ld {
        return Err(bad(
            NAME,
            format!("a share of {} packed floats for {n} rows", packed.len()),
        ));
    }
    k::rms_norm_deferred_packed(&x[first * h..(first + n) * h], g, eps, packed, r);
    Ok(())
}

/// Each block normalises its share of the rows (the prefill norms are one block per core).
pub(super) fn rms_norm(ctx: &TaskCtx<'_>) -> Result<(), KernelError> {
    const NAME: &str = "rms_norm_f32";
    let (rows, h) = dims2(ctx, norm::x)?;
    let x = ctx.read::<f32>(norm::x)?;
    let g = ctx.read::<f32>(norm::g)?;
    let NormScalars { eps } = NormScalars::read(ctx)?;
    if g.len() != h || x.len() != rows * h {
        return Err(bad(
            NAME,
            format!("norm weight of {} for {rows} rows of {h}", g.len()),
        ));
    }
    let mut packed = ctx.write_block_rows::<f32>(norm::packed)?;
    if packed.view_row_len() != k::packed_ld(h) {
        return Err(bad(
            NAME,
            format!("packed rows of {} for rows of {h}", packed.view_row_len()),
        ));
    }
    let first = packed.first_row();
    if first + packed.len() > rows {
        return Err(bad(
            NAME,
            format!(
                "packed rows {first}..{} for {rows} rows",
                first + packed.len()
            ),
        ));
    }
    for (i, dst) in packed.iter_mut().enumerate() {
        let r = first + i;
        k::rms_norm_packed(&x[r * h..(r + 1) * h], g, eps, dst);
    }
    Ok(())
}
